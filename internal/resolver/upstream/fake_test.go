package upstream

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// respondFunc returns the messages a fake upstream sends for req (nil: stay silent).
type respondFunc = dnsfake.Respond

// fakeUpstream is the shared fake nameserver (internal/dnsfake) on 127.0.0.1.
type fakeUpstream struct {
	*dnsfake.Server
	addr netip.AddrPort
}

func startFake(t testing.TB, fn respondFunc) *fakeUpstream {
	t.Helper()
	s, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: fn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return &fakeUpstream{Server: s, addr: s.Addr}
}

// queries returns the received queries, without health probes for ".".
func (f *fakeUpstream) queries() []dnsfake.Query {
	var out []dnsfake.Query
	for _, q := range f.Queries() {
		if q.Name != "." {
			out = append(out, q)
		}
	}
	return out
}

func (f *fakeUpstream) probes() int {
	n := 0
	for _, q := range f.Queries() {
		if q.Name == "." {
			n++
		}
	}
	return n
}

func (f *fakeUpstream) count() int { return len(f.queries()) }

// answerA answers every A query with one A record 192.0.2.1 and ttl, AAAA with NODATA
// and an SOA, and a probe for "." with an empty NOERROR.
func answerA(ttl uint32) respondFunc {
	return func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		m.RecursionAvailable = true
		q := req.Question[0]
		switch q.Qtype {
		case dns.TypeA:
			m.Answer = append(m.Answer, mustRR("%s %d IN A 192.0.2.1", q.Name, ttl))
		case dns.TypeAAAA:
			m.Ns = append(m.Ns, soa(q.Name, 300, 60))
		}
		return []*dns.Msg{m}
	}
}

func mustRR(format string, args ...any) dns.RR {
	rr, err := dns.NewRR(fmt.Sprintf(format, args...))
	if err != nil {
		panic(err)
	}
	return rr
}

// aRecords is n A records of name (10.0.x.y, TTL 300): an answer as large as
// the test needs, about 16 bytes a record on the wire.
func aRecords(name string, n int) []dns.RR {
	rrs := make([]dns.RR, 0, n)
	for i := range n {
		rrs = append(rrs, mustRR("%s 300 IN A 10.0.%d.%d", name, i/250, i%250+1))
	}
	return rrs
}

func soa(zone string, ttl, minttl uint32) dns.RR {
	return &dns.SOA{
		Hdr: dns.RR_Header{Name: zone, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: ttl},
		Ns:  "ns." + zone, Mbox: "hostmaster." + zone, Serial: 1, Refresh: 3600, Retry: 600, Expire: 86400, Minttl: minttl,
	}
}

// fakeClock is the forwarder's clock in tests.
type fakeClock struct{ ns atomic.Int64 }

func (c *fakeClock) now() int64              { return c.ns.Load() }
func (c *fakeClock) advance(d time.Duration) { c.ns.Add(int64(d)) }

// testForwarder builds a started forwarder on a fresh registry with a fake clock.
func testForwarder(t testing.TB, cfg Config) (*Forwarder, *prometheus.Registry, *fakeClock) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	f, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	clk := &fakeClock{}
	clk.ns.Store(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano())
	f.now = clk.now
	if err := f.Start(context.Background()); err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return f, reg, clk
}

// query builds a client query; opts: "do", "cd", "edns" (EDNS without DO), "ch" (class CHAOS).
func query(name string, qtype uint16, id uint16, opts ...string) *dns.Msg {
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	m.Id = id
	for _, o := range opts {
		switch o {
		case "do":
			m.SetEdns0(4096, true)
		case "edns":
			m.SetEdns0(4096, false)
		case "cd":
			m.CheckingDisabled = true
		case "ch":
			m.Question[0].Qclass = dns.ClassCHAOS
		}
	}
	return m
}

// toQuery is what the resolver passes for a client's request.
func toQuery(req *dns.Msg) *Query {
	q := &Query{Name: strings.ToLower(req.Question[0].Name), Qtype: req.Question[0].Qtype,
		Qclass: req.Question[0].Qclass, CD: req.CheckingDisabled, ClientID: req.Id}
	if opt := req.IsEdns0(); opt != nil {
		q.DO = opt.Do()
	}
	return q
}

// toMsg renders an Answer as the response to req, the way the resolver does: the
// client's header bits and question, the answer's sections.
func toMsg(t testing.TB, req *dns.Msg, a Answer) *dns.Msg {
	t.Helper()
	m := new(dns.Msg)
	m.Id, m.Response, m.Opcode = req.Id, true, req.Opcode
	m.RecursionDesired, m.CheckingDisabled = req.RecursionDesired, req.CheckingDisabled
	m.RecursionAvailable, m.Authoritative, m.Rcode = a.RecursionAvailable, a.Authoritative, a.Rcode
	m.AuthenticatedData = a.AuthenticData
	m.Question = req.Question
	var err error
	if m.Answer, m.Ns, m.Extra, err = a.RRs(); err != nil {
		t.Fatalf("answer records: %v", err)
	}
	if len(m.Answer) == 0 {
		m.Answer = nil
	}
	if len(m.Ns) == 0 {
		m.Ns = nil
	}
	if len(m.Extra) == 0 {
		m.Extra = nil
	}
	return m
}

// forwardMsg is Forward for a client message.
func forwardMsg(t testing.TB, ctx context.Context, f *Forwarder, req *dns.Msg) (*dns.Msg, Source, error) {
	t.Helper()
	a, err := f.Forward(ctx, toQuery(req))
	if err != nil {
		return nil, 0, err
	}
	return toMsg(t, req, a), a.Source, nil
}

func forward(t testing.TB, f *Forwarder, req *dns.Msg) (*dns.Msg, Source) {
	t.Helper()
	resp, src, err := forwardMsg(t, context.Background(), f, req)
	if err != nil {
		t.Fatalf("Forward %s: %v", req.Question[0].Name, err)
	}
	checkAnswers(t, req, resp)
	return resp, src
}

// checkAnswers checks the invariants of every answer: the records unpack, the response
// packs.
func checkAnswers(t testing.TB, req, resp *dns.Msg) {
	t.Helper()
	if resp.IsEdns0() != nil {
		t.Errorf("answer carries an OPT record; the caller adds its own")
	}
	if _, err := resp.Pack(); err != nil {
		t.Errorf("answer does not pack: %v", err)
	}
}

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
