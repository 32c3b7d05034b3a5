package main

import (
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/miekg/dns"
)

func serveTest(t *testing.T, h dns.Handler) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	s := &dns.Server{PacketConn: pc, Handler: h, NotifyStartedFunc: func() { close(started) }}
	go func() { _ = s.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = s.Shutdown() })
	return pc.LocalAddr().String()
}

// upstream answers a.example.com A 192.0.2.1 (TTL 60), NXDOMAIN+SOA for the rest,
// and counts what it is asked.
type upstream struct{ asked map[string]int }

func (u *upstream) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	q := req.Question[0]
	u.asked[q.Name]++
	m := new(dns.Msg)
	m.SetReply(req)
	if q.Name == "a.example.com." && q.Qtype == dns.TypeA {
		rr, _ := dns.NewRR("a.example.com. 60 IN A 192.0.2.1")
		m.Answer = []dns.RR{rr}
	} else {
		m.Rcode = dns.RcodeNameError
		soa, _ := dns.NewRR("example.com. 60 IN SOA ns. host. 1 2 3 4 30")
		m.Ns = []dns.RR{soa}
	}
	_ = w.WriteMsg(m)
}

func TestFloor(t *testing.T) {
	up := &upstream{asked: map[string]int{}}
	upAddr := serveTest(t, up)
	hosts := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hosts, []byte("# table\n240.0.0.1 svc-0.ns-0.svc.cluster.local\n240.0.0.2 svc-1.ns-0.svc.cluster.local other.cluster.local\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s := &server{zone: "cluster.local.", ttl: 30, upstream: upAddr,
		client: &dns.Client{Net: "udp", Timeout: time.Second}, cache: map[cacheKey]cacheEntry{}}
	if n, err := s.load(hosts); err != nil || n != 3 {
		t.Fatalf("load = %d, %v", n, err)
	}
	addr := serveTest(t, s)
	for _, tc := range []struct {
		name   string
		qtype  uint16
		rcode  int
		answer string
		soa    bool
	}{
		{"svc-0.ns-0.svc.cluster.local.", dns.TypeA, dns.RcodeSuccess, "240.0.0.1", false},
		{"SVC-1.ns-0.svc.cluster.local.", dns.TypeA, dns.RcodeSuccess, "240.0.0.2", false},
		{"other.cluster.local.", dns.TypeA, dns.RcodeSuccess, "240.0.0.2", false},
		{"svc-0.ns-0.svc.cluster.local.", dns.TypeAAAA, dns.RcodeSuccess, "", true},
		{"svc-0.ns-0.svc.cluster.local.ns-0.svc.cluster.local.", dns.TypeA, dns.RcodeNameError, "", true},
		{"a.example.com.", dns.TypeA, dns.RcodeSuccess, "192.0.2.1", false},
		{"a.example.com.", dns.TypeA, dns.RcodeSuccess, "192.0.2.1", false}, // cached
		{"b.example.com.", dns.TypeA, dns.RcodeNameError, "", true},
		{"b.example.com.", dns.TypeA, dns.RcodeNameError, "", true}, // cached
	} {
		m := new(dns.Msg)
		m.SetQuestion(tc.name, tc.qtype)
		r, err := dns.Exchange(m, addr)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		got := ""
		if len(r.Answer) > 0 {
			got = r.Answer[0].(*dns.A).A.String()
		}
		if r.Id != m.Id || r.Rcode != tc.rcode || got != tc.answer || (len(r.Ns) > 0) != tc.soa {
			t.Errorf("%s %s: rcode %s answer %q ns %v id ok %v; want %s %q soa %v", tc.name, dns.TypeToString[tc.qtype],
				dns.RcodeToString[r.Rcode], got, r.Ns, r.Id == m.Id, dns.RcodeToString[tc.rcode], tc.answer, tc.soa)
		}
	}
	if up.asked["a.example.com."] != 1 || up.asked["b.example.com."] != 1 || len(up.asked) != 2 {
		t.Errorf("upstream asked %v, want each forwarded name once (cache)", up.asked)
	}

	// Reload: a changed file replaces the table.
	if err := os.WriteFile(hosts, []byte("240.0.0.9 svc-0.ns-0.svc.cluster.local\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.load(hosts); err != nil {
		t.Fatal(err)
	}
	if ips := (*s.tab.Load())["svc-0.ns-0.svc.cluster.local."]; len(ips) != 1 || ips[0] != netip.MustParseAddr("240.0.0.9") {
		t.Errorf("after reload: %v", ips)
	}
	if _, ok := (*s.tab.Load())["other.cluster.local."]; ok {
		t.Error("after reload: removed name still present")
	}
}

func TestParseHostsErrors(t *testing.T) {
	for _, in := range []string{"not-an-ip name\n", "240.0.0.1\n"} {
		if _, err := parseHosts([]byte(in)); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
}
