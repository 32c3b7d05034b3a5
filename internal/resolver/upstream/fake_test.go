package upstream

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
)

// seenQuery is one query a fake upstream received.
type seenQuery struct {
	proto   string
	src     netip.AddrPort
	id      uint16
	name    string
	qtype   uint16
	do, cd  bool
	udpSize uint16 // 0 = no OPT
}

// respondFunc returns the messages a fake upstream sends for req (nil: stay silent).
// Over TCP only the first is sent.
type respondFunc func(proto string, req *dns.Msg) []*dns.Msg

// fakeUpstream is a DNS server on 127.0.0.1 (UDP and TCP on one port) whose answers the
// test scripts. Each query is handled in its own goroutine.
type fakeUpstream struct {
	t       testing.TB
	addr    netip.AddrPort
	pc      *net.UDPConn
	ln      net.Listener
	respond atomic.Pointer[respondFunc]
	delay   atomic.Int64
	mu      sync.Mutex
	seen    []seenQuery
	closed  atomic.Bool
}

func startFake(t testing.TB, fn respondFunc) *fakeUpstream {
	t.Helper()
	f := &fakeUpstream{t: t}
	f.setRespond(fn)
	var err error
	for range 20 {
		f.pc, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatalf("listen udp: %v", err)
		}
		port := f.pc.LocalAddr().(*net.UDPAddr).Port
		f.ln, err = net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err == nil {
			f.addr = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
			break
		}
		f.pc.Close()
	}
	if err != nil {
		t.Fatalf("listen tcp: %v", err)
	}
	go f.serveUDP()
	go f.serveTCP()
	t.Cleanup(f.close)
	return f
}

func (f *fakeUpstream) setRespond(fn respondFunc) { f.respond.Store(&fn) }

func (f *fakeUpstream) close() {
	if f.closed.CompareAndSwap(false, true) {
		f.pc.Close()
		f.ln.Close()
	}
}

func (f *fakeUpstream) record(proto string, src netip.AddrPort, req *dns.Msg) {
	s := seenQuery{proto: proto, src: src, id: req.Id, cd: req.CheckingDisabled}
	if len(req.Question) > 0 {
		s.name, s.qtype = req.Question[0].Name, req.Question[0].Qtype
	}
	if opt := req.IsEdns0(); opt != nil {
		s.do, s.udpSize = opt.Do(), opt.UDPSize()
	}
	f.mu.Lock()
	f.seen = append(f.seen, s)
	f.mu.Unlock()
}

// queries returns the received queries, without health probes for ".".
func (f *fakeUpstream) queries() []seenQuery {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []seenQuery
	for _, s := range f.seen {
		if s.name != "." {
			out = append(out, s)
		}
	}
	return out
}

func (f *fakeUpstream) probes() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, s := range f.seen {
		if s.name == "." {
			n++
		}
	}
	return n
}

func (f *fakeUpstream) count() int { return len(f.queries()) }

func (f *fakeUpstream) serveUDP() {
	buf := make([]byte, 65535)
	for {
		n, src, err := f.pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		req := new(dns.Msg)
		if err := req.Unpack(buf[:n]); err != nil {
			continue
		}
		f.record("udp", src, req)
		go func() {
			time.Sleep(time.Duration(f.delay.Load()))
			for _, m := range (*f.respond.Load())("udp", req) {
				b, err := m.Pack()
				if err != nil {
					f.t.Errorf("fake upstream: pack: %v", err)
					return
				}
				_, _ = f.pc.WriteToUDPAddrPort(b, src)
			}
		}()
	}
}

func (f *fakeUpstream) serveTCP() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			var l [2]byte
			if _, err := io.ReadFull(c, l[:]); err != nil {
				return
			}
			b := make([]byte, binary.BigEndian.Uint16(l[:]))
			if _, err := io.ReadFull(c, b); err != nil {
				return
			}
			req := new(dns.Msg)
			if err := req.Unpack(b); err != nil {
				return
			}
			f.record("tcp", netip.MustParseAddrPort(c.RemoteAddr().String()), req)
			time.Sleep(time.Duration(f.delay.Load()))
			ms := (*f.respond.Load())("tcp", req)
			if len(ms) == 0 {
				return
			}
			out, err := ms[0].Pack()
			if err != nil {
				f.t.Errorf("fake upstream: pack: %v", err)
				return
			}
			_, _ = c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(out))), out...))
		}()
	}
}

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
	ctx, cancel := context.WithCancel(context.Background())
	f.Start(ctx)
	t.Cleanup(func() {
		cancel()
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

func forward(t testing.TB, f *Forwarder, req *dns.Msg) (*dns.Msg, string) {
	t.Helper()
	resp, src, err := f.Forward(context.Background(), req)
	if err != nil {
		t.Fatalf("Forward %s: %v", req.Question[0].Name, err)
	}
	checkAnswers(t, req, resp)
	return resp, src
}

// checkAnswers checks the invariants of every answer: same ID, the question exactly as
// asked, QR set, not truncated, no OPT.
func checkAnswers(t testing.TB, req, resp *dns.Msg) {
	t.Helper()
	if resp.Id != req.Id {
		t.Errorf("answer id %d, want the client's %d", resp.Id, req.Id)
	}
	if len(resp.Question) != 1 || resp.Question[0] != req.Question[0] {
		t.Errorf("answer question %v, want exactly %v", resp.Question, req.Question)
	}
	if !resp.Response || resp.Truncated {
		t.Errorf("answer QR=%v TC=%v, want QR and no TC", resp.Response, resp.Truncated)
	}
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
