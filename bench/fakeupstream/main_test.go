package main

import (
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

func TestFakeUpstream(t *testing.T) {
	h := &handler{ttl: 300, nx: []string{"nx.example.net.", "cluster.local."}}
	srv, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: h.respond, NoRecord: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	addr := srv.Addr.String()
	for _, tc := range []struct {
		name    string
		qtype   uint16
		rcode   int
		answer  string // A answer, "" = none
		soaZone string // SOA owner in authority, "" = none
	}{
		{"e-1.example.com.", dns.TypeA, dns.RcodeSuccess, meshdata.ExternalIP("e-1.example.com.").String(), ""},
		{"E-1.Example.Com.", dns.TypeA, dns.RcodeSuccess, meshdata.ExternalIP("e-1.example.com.").String(), ""},
		{"e-1.example.com.", dns.TypeAAAA, dns.RcodeSuccess, "", "example.com."},
		{"x.nx.example.net.", dns.TypeA, dns.RcodeNameError, "", "nx.example.net."},
		{"a.b.nx.example.net.", dns.TypeAAAA, dns.RcodeNameError, "", "nx.example.net."},
		{"svc-1.ns-1.svc.cluster.local.", dns.TypeA, dns.RcodeNameError, "", "cluster.local."},
	} {
		m := new(dns.Msg)
		m.SetQuestion(tc.name, tc.qtype)
		r, err := dns.Exchange(m, addr)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if r.Id != m.Id || r.Rcode != tc.rcode {
			t.Errorf("%s %s: rcode %s id %d, want %s id %d", tc.name, dns.TypeToString[tc.qtype], dns.RcodeToString[r.Rcode], r.Id, dns.RcodeToString[tc.rcode], m.Id)
		}
		gotA := ""
		for _, rr := range r.Answer {
			if a, ok := rr.(*dns.A); ok {
				gotA = a.A.String()
				if a.Hdr.Ttl != 300 || a.Hdr.Name != tc.name {
					t.Errorf("%s: answer %v, want TTL 300 and the query's name", tc.name, a)
				}
			}
		}
		if gotA != tc.answer {
			t.Errorf("%s %s: answer %q, want %q", tc.name, dns.TypeToString[tc.qtype], gotA, tc.answer)
		}
		gotSOA := ""
		for _, rr := range r.Ns {
			if soa, ok := rr.(*dns.SOA); ok {
				gotSOA = soa.Hdr.Name
				if soa.Minttl != 300 {
					t.Errorf("%s: SOA minimum %d, want 300", tc.name, soa.Minttl)
				}
			}
		}
		if gotSOA != tc.soaZone {
			t.Errorf("%s %s: SOA %q, want %q", tc.name, dns.TypeToString[tc.qtype], gotSOA, tc.soaZone)
		}
	}
	if got := srv.Count(); got != 6 {
		t.Errorf("counted %d queries, want 6", got)
	}
}
