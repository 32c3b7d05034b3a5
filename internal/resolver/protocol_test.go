package resolver

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

// Protocol errors, malformed packets, forwarder failures and truncation: whole
// messages in, whole messages out.

func TestProtocolErrors(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	withMsg := func(f func(m *dns.Msg)) func() *dns.Msg {
		return func() *dns.Msg {
			m := query("productpage.ns1.svc.cluster.local.", dns.TypeA)()
			f(m)
			return m
		}
	}
	cases := []tcase{
		{name: "no question", req: withMsg(func(m *dns.Msg) { m.Question = nil }), rcode: dns.RcodeFormatError},
		{name: "two questions", req: withMsg(func(m *dns.Msg) {
			m.Question = append(m.Question, dns.Question{Name: "a.", Qtype: dns.TypeA, Qclass: dns.ClassINET})
		}), rcode: dns.RcodeFormatError},
		{name: "response sent to us", req: withMsg(func(m *dns.Msg) { m.Response = true }), rcode: dns.RcodeFormatError},
		{name: "NOTIFY", req: withMsg(func(m *dns.Msg) { m.Opcode = dns.OpcodeNotify }), rcode: dns.RcodeNotImplemented},
		{name: "UPDATE", req: withMsg(func(m *dns.Msg) { m.Opcode = dns.OpcodeUpdate }), rcode: dns.RcodeNotImplemented},
		{name: "class CH other", req: withMsg(func(m *dns.Msg) { m.Question[0].Qclass = dns.ClassCHAOS }), rcode: dns.RcodeRefused},
		{name: "class HS", req: withMsg(func(m *dns.Msg) { m.Question[0].Qclass = dns.ClassHESIOD }), rcode: dns.RcodeRefused},
		{name: "AXFR", req: withMsg(func(m *dns.Msg) { m.Question[0].Qtype = dns.TypeAXFR }), rcode: dns.RcodeRefused},
		{name: "EDNS version 1", req: withMsg(func(m *dns.Msg) {
			m.SetEdns0(1232, false)
			m.IsEdns0().SetVersion(1)
		}), rcode: dns.RcodeBadVers, opt: "OPT udp=1232 do=false ver=0 ext=16 opts=0"},
	}
	runCases(t, ts, cases)

	// CH TXT version.bind is answered.
	for _, network := range []string{"udp", "tcp"} {
		m := new(dns.Msg)
		m.Question = []dns.Question{{Name: "version.bind.", Qtype: dns.TypeTXT, Qclass: dns.ClassCHAOS}}
		resp := exchange(t, network, ts.addr, m)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 || !strings.Contains(resp.Answer[0].String(), "meshdns-ebpf") {
			t.Fatalf("%s version.bind: %v", network, resp)
		}
	}
}

// Packets that do not parse get FORMERR with their ID (both transports);
// a FORMERR response sent to us gets no answer (it would loop), counted.
func TestMalformedPackets(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	good, _ := query("productpage.ns1.svc.cluster.local.", dns.TypeA)().Pack()
	for _, network := range []string{"udp", "tcp"} {
		for _, pkt := range [][]byte{
			good[:len(good)-3],                            // question cut short
			append(good[:12:12], 0xc0, 0x0c, 0, 1),        // pointer loop
			append(append([]byte{}, good...), 0xde, 0xad), // trailing garbage
		} {
			raw := exchangeRaw(t, network, ts.addr, pkt)
			if len(raw) != 12 || raw[0] != 0x12 || raw[1] != 0x34 || raw[2]&0x80 == 0 || raw[3]&0xf != dns.RcodeFormatError {
				// Trailing garbage unpacks fine in miekg/dns: then it must be a real answer.
				resp := new(dns.Msg)
				if err := resp.Unpack(raw); err != nil || resp.Id != 0x1234 || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
					t.Fatalf("%s %x: reply %x", network, pkt, raw)
				}
			}
		}
	}
	before := metrictest.Value(t, ts.reg, "meshdns_dns_dropped_total")
	formerrResp := []byte{0x12, 0x34, 0x80, 0x01, 0, 0, 0, 0, 0, 0, 0, 0}
	c, err := net.Dial("udp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(formerrResp); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(make([]byte, 512)); err == nil {
		t.Fatalf("got a %d-byte answer to a FORMERR response", n)
	}
	deadline := time.Now().Add(2 * time.Second)
	for metrictest.Value(t, ts.reg, "meshdns_dns_dropped_total") != before+1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := metrictest.Value(t, ts.reg, "meshdns_dns_dropped_total"); got != before+1 {
		t.Fatalf("dropped = %v, want %v", got, before+1)
	}
}

func TestForwarderFailureIsServfail(t *testing.T) {
	ts := startServer(t, testFile(), func(c *Config) { c.Forwarder = failingForwarder{} })
	runCases(t, ts, []tcase{
		{name: "servfail", req: query("ext.example.org.", dns.TypeA), rcode: dns.RcodeServerFailure},
		{name: "servfail edns", req: queryEDNS("ext.example.org.", dns.TypeA, 1232, false), rcode: dns.RcodeServerFailure,
			opt: "OPT udp=1232 do=false ver=0 ext=0 opts=0"},
	})
	if got := metrictest.Value(t, ts.reg, "meshdns_dns_responses_total", "rcode", "SERVFAIL", "source", "error"); got != 4 {
		t.Fatalf("SERVFAIL/error responses = %v, want 4", got)
	}
}

func TestTruncation(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	name := "headless.ns2.svc.cluster.local."
	tests := []struct {
		network  string
		req      func() *dns.Msg
		tc       bool
		maxBytes int
		all      bool
	}{
		{"udp", query(name, dns.TypeA), true, 512, false},
		{"udp", queryEDNS(name, dns.TypeA, 1000, false), true, 1000, false},
		{"udp", queryEDNS(name, dns.TypeA, 4096, false), false, 4096, true},
		{"tcp", query(name, dns.TypeA), false, 65535, true},
		// forwarded answers are truncated too (40 TXT of ~70 bytes)
		{"udp", query("big.example.org.", dns.TypeTXT), true, 512, false},
		{"udp", queryEDNS("big.example.org.", dns.TypeTXT, 4096, false), false, 4096, true},
		{"tcp", query("big.example.org.", dns.TypeTXT), false, 65535, true},
	}
	for _, tt := range tests {
		req := tt.req()
		t.Run(fmt.Sprintf("%s/%s/%d", tt.network, req.Question[0].Name, tt.maxBytes), func(t *testing.T) {
			pkt, _ := req.Pack()
			raw := exchangeRaw(t, tt.network, ts.addr, pkt)
			resp := new(dns.Msg)
			if err := resp.Unpack(raw); err != nil {
				t.Fatal(err)
			}
			if len(raw) > tt.maxBytes {
				t.Fatalf("%d bytes, limit %d", len(raw), tt.maxBytes)
			}
			if resp.Truncated != tt.tc {
				t.Fatalf("TC = %v, want %v", resp.Truncated, tt.tc)
			}
			if tt.all && len(resp.Answer) != 100 && len(resp.Answer) != 40 {
				t.Fatalf("%d answers, want all", len(resp.Answer))
			}
			if !tt.all && len(resp.Answer) == 0 {
				t.Fatalf("truncated answer carries no records")
			}
			if (req.IsEdns0() != nil) != (resp.IsEdns0() != nil) {
				t.Fatalf("OPT presence differs: req %v resp %v", req.IsEdns0() != nil, resp.IsEdns0() != nil)
			}
		})
	}
}
