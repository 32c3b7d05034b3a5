package upstream

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

// deadAddr returns a 127.0.0.1 port where queries are refused (ICMP port unreachable).
// The port stays held until the test ends by a socket connected to itself: it takes no
// datagram from anyone else, so the kernel refuses them, and no socket of a test running
// beside us can bind the port and swallow our queries.
func deadAddr(t *testing.T) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort("127.0.0.1:0")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	a := pc.LocalAddr().(*net.UDPAddr).AddrPort()
	rc, err := pc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cerr = syscall.Connect(int(fd), &syscall.SockaddrInet4{Port: int(a.Port()), Addr: a.Addr().As4()})
	}); err != nil || cerr != nil {
		t.Fatalf("connect %s to itself: %v %v", a, err, cerr)
	}
	return a
}

// silent answers nothing (a black hole: the client times out).
func silent(string, *dns.Msg) []*dns.Msg { return nil }

func TestFailover(t *testing.T) {
	var alive atomic.Bool
	deadFn := answerA(300)
	dead := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		if alive.Load() {
			return deadFn(proto, req)
		}
		return nil
	})
	live := startFake(t, answerA(300))
	cfg := NewConfig(dead.addr, live.addr)
	cfg.AttemptTimeout = 300 * time.Millisecond
	cfg.HealthInterval = 100 * time.Millisecond
	cfg.MaxFails = 1 // the default threshold has its own test (TestOneLostReplyKeepsUpstreamHealthy)
	f, reg, _ := testForwarder(t, cfg)

	// Random order: ask until the dead one got a query; that query still succeeds via
	// the live one, within one attempt timeout.
	i := 0
	for ; dead.count() == 0 && i < 64; i++ {
		start := time.Now()
		forward(t, f, query(fmt.Sprintf("a%d.example.", i), dns.TypeA, uint16(i)))
		if el := time.Since(start); el > cfg.AttemptTimeout+300*time.Millisecond {
			t.Fatalf("query %d took %s", i, el)
		}
	}
	if dead.count() != 1 {
		t.Fatalf("dead upstream saw %d queries after %d lookups, want 1", dead.count(), i)
	}
	h := f.Healthy()
	if h[0].Healthy || !h[1].Healthy || h[0].LastError == "" || h[0].Server != dead.addr {
		t.Fatalf("health after the failure: %+v", h)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_healthy", "upstream", dead.addr.String()); got != 0 {
		t.Errorf("meshdns_upstream_healthy{dead} = %v, want 0", got)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", dead.addr.String(), "reason", "timeout"); got != 1 {
		t.Errorf("meshdns_upstream_failures_total{dead,timeout} = %v, want 1", got)
	}
	// From now on the dead one is skipped: fast answers, no queries to it.
	for j := range 20 {
		start := time.Now()
		forward(t, f, query(fmt.Sprintf("b%d.example.", j), dns.TypeA, uint16(j)))
		// Asking the dead one first would cost its 300 ms attempt timeout.
		if el := time.Since(start); el > 200*time.Millisecond {
			t.Errorf("query after the failure took %s: dead upstream not skipped", el)
		}
	}
	if dead.count() != 1 {
		t.Errorf("dead upstream saw %d queries, want it skipped after the first failure", dead.count())
	}
	// It is probed in the background and comes back once it answers.
	waitFor(t, 2*time.Second, "health probes of the dead upstream", func() bool { return dead.probes() >= 2 })
	alive.Store(true)
	waitFor(t, 2*time.Second, "the recovered upstream to be healthy", func() bool { return f.Healthy()[0].Healthy })
	if got := metrictest.Value(t, reg, "meshdns_upstream_healthy", "upstream", dead.addr.String()); got != 1 {
		t.Errorf("meshdns_upstream_healthy{recovered} = %v, want 1", got)
	}
	before := dead.count()
	for j := 0; dead.count() == before && j < 64; j++ {
		forward(t, f, query(fmt.Sprintf("c%d.example.", j), dns.TypeA, uint16(j)))
	}
	if dead.count() == before {
		t.Errorf("recovered upstream gets no queries")
	}
}

func TestAllUpstreamsFail(t *testing.T) {
	cases := []struct {
		name       string
		servers    func(t *testing.T) []netip.AddrPort
		wantReason string
	}{
		{"black holes", func(t *testing.T) []netip.AddrPort {
			return []netip.AddrPort{startFake(t, silent).addr, startFake(t, silent).addr}
		}, "timeout"},
		{"refused", func(t *testing.T) []netip.AddrPort { return []netip.AddrPort{deadAddr(t), deadAddr(t)} }, "refused"},
		{"one of each", func(t *testing.T) []netip.AddrPort { return []netip.AddrPort{startFake(t, silent).addr, deadAddr(t)} }, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			servers := tc.servers(t)
			cfg := NewConfig(servers...)
			cfg.Timeout = time.Second
			cfg.AttemptTimeout = 300 * time.Millisecond
			cfg.MaxFails = 1
			f, reg, _ := testForwarder(t, cfg)
			start := time.Now()
			resp, src, err := forwardMsg(t, context.Background(), f, query("fail.example.", dns.TypeA, 7))
			el := time.Since(start)
			if err == nil || !errors.Is(err, ErrAllFailed) {
				t.Fatalf("Forward = %v %q %v, want ErrAllFailed", resp, src, err)
			}
			if el > cfg.Timeout+200*time.Millisecond {
				t.Errorf("failure took %s, want under the timeout %s", el, cfg.Timeout)
			}
			if tc.wantReason != "" {
				for _, s := range servers {
					if got := metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", s.String(), "reason", tc.wantReason); got < 1 {
						t.Errorf("failures{%s,%s} = %v, want >= 1", s, tc.wantReason, got)
					}
				}
			}
			for _, h := range f.Healthy() {
				if h.Healthy {
					t.Errorf("%s still healthy", h.Server)
				}
			}
		})
	}
}

func TestTCPRetryOnTruncation(t *testing.T) {
	const n = 100 // about 1.6 KB: more than the advertised 1232 bytes
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		if proto == "udp" {
			m.Truncated = true
			return []*dns.Msg{m}
		}
		m.Answer = aRecords(req.Question[0].Name, n)
		return []*dns.Msg{m}
	})
	f, reg, _ := testForwarder(t, NewConfig(up.addr))
	resp, src := forward(t, f, query("big.example.", dns.TypeA, 3))
	if src != SourceUpstream || len(resp.Answer) != n {
		t.Fatalf("source %q with %d answers, want upstream with %d", src, len(resp.Answer), n)
	}
	qs := up.queries()
	if len(qs) != 2 || qs[0].Proto != "udp" || qs[1].Proto != "tcp" {
		t.Fatalf("upstream saw %+v, want udp then tcp", qs)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_requests_total", "upstream", up.addr.String(), "proto", "tcp"); got != 1 {
		t.Errorf("requests{tcp} = %v, want 1", got)
	}
	// The full answer is cached, not the truncated one.
	if resp, src := forward(t, f, query("big.example.", dns.TypeA, 4)); src != SourceCache || len(resp.Answer) != n {
		t.Errorf("second query: source %q with %d answers, want cache with %d", src, len(resp.Answer), n)
	}
}

func TestTruncatedEverywhereNotCached(t *testing.T) {
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		m.Truncated = true
		return []*dns.Msg{m}
	})
	cfg := NewConfig(up.addr)
	cfg.Timeout = time.Second
	f, reg, _ := testForwarder(t, cfg)
	if _, _, err := forwardMsg(t, context.Background(), f, query("tc.example.", dns.TypeA, 1)); err == nil {
		t.Fatal("answer truncated over UDP and TCP: want an error")
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", up.addr.String(), "reason", "truncated"); got < 1 {
		t.Errorf("failures{truncated} = %v, want >= 1", got)
	}
	if got := metrictest.Value(t, reg, "meshdns_cache_entries"); got != 0 {
		t.Errorf("cache holds %v entries, want 0", got)
	}
}

func TestEDNSUpstream(t *testing.T) {
	// The fake honours the advertised size: over it, it truncates (as real servers do).
	const n = 50 // ~850 bytes
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		for i := range n {
			m.Answer = append(m.Answer, mustRR("%s 300 IN A 10.1.0.%d", req.Question[0].Name, i+1))
		}
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
			m.SetEdns0(opt.UDPSize(), opt.Do())
		}
		if proto == "udp" {
			m.Truncate(size)
		}
		return []*dns.Msg{m}
	})
	cases := []struct {
		name   string
		opts   []string
		do, cd bool
	}{
		{"no edns", nil, false, false},
		{"edns", []string{"edns"}, false, false},
		{"do", []string{"do"}, true, false},
		{"cd", []string{"cd"}, false, true},
		{"do cd", []string{"do", "cd"}, true, true},
	}
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := len(up.queries())
			req := query(fmt.Sprintf("edns%d.example.", i), dns.TypeA, uint16(i), tc.opts...)
			resp, _ := forward(t, f, req)
			if len(resp.Answer) != n {
				t.Errorf("%d answers, want %d", len(resp.Answer), n)
			}
			if resp.CheckingDisabled != tc.cd {
				t.Errorf("answer CD=%v, want the client's %v", resp.CheckingDisabled, tc.cd)
			}
			qs := up.queries()[before:]
			if len(qs) != 1 || qs[0].Proto != "udp" {
				t.Fatalf("upstream saw %+v, want one UDP query (no TCP fallback needed)", qs)
			}
			if qs[0].UDPSize != EDNSBufferSize || qs[0].DO != tc.do || qs[0].CD != tc.cd {
				t.Errorf("upstream query size %d DO %v CD %v, want %d %v %v", qs[0].UDPSize, qs[0].DO, qs[0].CD, EDNSBufferSize, tc.do, tc.cd)
			}
		})
	}
}

// Every upstream query has a random ID, never the client's; the source port changes
// every socketUses queries, and a socket no longer used is closed.
func TestRandomIDsAndRotatedPorts(t *testing.T) {
	up := startFake(t, answerA(300))
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	const clientID, n = 0x1234, 4 * socketUses
	for i := range n {
		resp, _ := forward(t, f, query(fmt.Sprintf("r%d.Example.", i), dns.TypeA, clientID))
		if resp.Id != clientID {
			t.Fatalf("answer id %#x, want the client's %#x", resp.Id, clientID)
		}
	}
	ids, ports := map[uint16]bool{}, map[uint16]int{}
	for _, q := range up.queries() {
		if q.ID == clientID {
			t.Errorf("upstream saw the client's id %#x", q.ID)
		}
		ids[q.ID] = true
		ports[q.Source.Port()]++
	}
	if len(ids) < n-n/10 {
		t.Errorf("%d queries used %d ids, want (nearly) all distinct", n, len(ids))
	}
	if len(ports) < n/socketUses {
		t.Errorf("%d queries came from %d source ports, want at least %d", n, len(ports), n/socketUses)
	}
	for port, k := range ports {
		if k > socketUses {
			t.Errorf("source port %d sent %d queries, want at most %d", port, k, socketUses)
		}
	}
	if open := openSockets(f); open > 1 {
		t.Errorf("%d upstream sockets open with no query waiting, want at most the current one", open)
	}
}

// A socket takes no new query once it is socketAge old, however few it carried.
func TestIdleSocketNotReusedAfterItsAge(t *testing.T) {
	up := startFake(t, answerA(300))
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	forward(t, f, query("first.example.", dns.TypeA, 1))
	opened := time.Now()
	waitFor(t, 3*socketAge, "the socket to age", func() bool { return time.Since(opened) > socketAge })
	forward(t, f, query("second.example.", dns.TypeA, 2))
	qs := up.queries()
	if len(qs) != 2 || qs[0].Source.Port() == qs[1].Source.Port() {
		t.Fatalf("upstream saw %+v, want two queries from two source ports", qs)
	}
	if open := openSockets(f); open != 1 {
		t.Errorf("%d upstream sockets open, want only the current one", open)
	}
}

func openSockets(f *Forwarder) int {
	n := 0
	for _, s := range f.servers {
		s.sockets.mu.Lock()
		n += len(s.sockets.open)
		s.sockets.mu.Unlock()
	}
	return n
}

func TestMismatchedRepliesDropped(t *testing.T) {
	up := startFake(t, func(_ string, req *dns.Msg) []*dns.Msg {
		spoof := func(edit func(m *dns.Msg)) *dns.Msg {
			m := new(dns.Msg)
			m.SetReply(req)
			m.Answer = []dns.RR{mustRR("%s 300 IN A 6.6.6.6", req.Question[0].Name)}
			edit(m)
			return m
		}
		good := new(dns.Msg)
		good.SetReply(req)
		good.Answer = []dns.RR{mustRR("%s 300 IN A 192.0.2.99", req.Question[0].Name)}
		return []*dns.Msg{
			spoof(func(m *dns.Msg) { m.Id++ }),
			spoof(func(m *dns.Msg) { m.Question[0].Name = "evil.example." }),
			spoof(func(m *dns.Msg) { m.Question[0].Qtype = dns.TypeAAAA }),
			spoof(func(m *dns.Msg) { m.Response = false }),
			spoof(func(m *dns.Msg) { m.Question = nil }),
			good,
		}
	})
	f, reg, _ := testForwarder(t, NewConfig(up.addr))
	resp, _ := forward(t, f, query("victim.example.", dns.TypeA, 5))
	if len(resp.Answer) != 1 || resp.Answer[0].(*dns.A).A.String() != "192.0.2.99" {
		t.Fatalf("answer %v, want only the matching reply 192.0.2.99", resp.Answer)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", up.addr.String(), "reason", "mismatch"); got != 5 {
		t.Errorf("failures{mismatch} = %v, want 5", got)
	}
}

func TestMaxInFlight(t *testing.T) {
	up := startFake(t, answerA(300))
	up.SetDelay(300 * time.Millisecond)
	cfg := NewConfig(up.addr)
	cfg.MaxInFlight = 2
	f, reg, _ := testForwarder(t, cfg)
	done := make(chan error, 3)
	for _, n := range []string{"x1.example.", "x2.example.", "x1.example."} { // the third joins the first
		go func() {
			_, _, err := forwardMsg(t, context.Background(), f, query(n, dns.TypeA, 1))
			done <- err
		}()
	}
	waitFor(t, time.Second, "two upstream queries in flight", func() bool { return up.count() == 2 })
	start := time.Now()
	_, _, err := forwardMsg(t, context.Background(), f, query("x3.example.", dns.TypeA, 2))
	// Waiting for a slot would take the upstream's 300 ms delay.
	if !errors.Is(err, ErrOverloaded) || time.Since(start) > 150*time.Millisecond {
		t.Errorf("third distinct query: err %v after %s, want ErrOverloaded at once", err, time.Since(start))
	}
	for range 3 {
		if err := <-done; err != nil {
			t.Errorf("query within the cap: %v", err)
		}
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", "", "reason", "overload"); got != 1 {
		t.Errorf("failures{overload} = %v, want 1", got)
	}
	// Capacity is released.
	forward(t, f, query("x3.example.", dns.TypeA, 3))
}

func TestCallerDeadline(t *testing.T) {
	up := startFake(t, answerA(300))
	up.SetDelay(400 * time.Millisecond)
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, _, err := forwardMsg(t, ctx, f, query("slow.example.", dns.TypeA, 1)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want the caller's deadline", err)
	}
	// The shared upstream query went on and filled the cache.
	waitFor(t, time.Second, "the cached answer", func() bool {
		_, src, err := forwardMsg(t, context.Background(), f, query("slow.example.", dns.TypeA, 2))
		return err == nil && src == SourceCache
	})
}

func TestMetricsPrecreated(t *testing.T) {
	a, b := startFake(t, answerA(300)), startFake(t, answerA(300))
	_, reg, _ := testForwarder(t, NewConfig(a.addr, b.addr))
	for _, s := range []string{a.addr.String(), b.addr.String()} {
		for _, p := range []string{"udp", "tcp"} {
			if got := metrictest.Value(t, reg, "meshdns_upstream_requests_total", "upstream", s, "proto", p); got != 0 {
				t.Errorf("requests{%s,%s} = %v, want 0", s, p, got)
			}
		}
		for _, r := range failureReasons {
			metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", s, "reason", r)
		}
		if got := metrictest.Value(t, reg, "meshdns_upstream_healthy", "upstream", s); got != 1 {
			t.Errorf("healthy{%s} = %v, want 1", s, got)
		}
		metrictest.Value(t, reg, "meshdns_upstream_request_duration_seconds", "upstream", s)
	}
	for _, ty := range []string{"success", "denial", "stale"} {
		metrictest.Value(t, reg, "meshdns_cache_hits_total", "type", ty)
	}
	for _, n := range []string{"meshdns_cache_misses_total", "meshdns_cache_entries", "meshdns_cache_prefetch_total", "meshdns_cache_evictions_total"} {
		metrictest.Value(t, reg, n)
	}
}

func TestNewAndCloseRegistry(t *testing.T) {
	up := startFake(t, answerA(300))
	f, reg, _ := testForwarder(t, NewConfig(up.addr))
	cfg := NewConfig(up.addr)
	cfg.Registerer = reg
	if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), "already registered") {
		t.Errorf("second Forwarder on one registry: err %v, want already registered", err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := forwardMsg(t, context.Background(), f, query("closed.example.", dns.TypeA, 1)); !errors.Is(err, ErrClosed) {
		t.Errorf("Forward after Close: %v, want ErrClosed", err)
	}
	f2, err := New(cfg)
	if err != nil {
		t.Fatalf("New after Close on the same registry: %v", err)
	}
	f2.Close()
}

func TestConfig(t *testing.T) {
	a := netip.MustParseAddrPort("127.0.0.1:53")
	cases := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"no servers", Config{}, "no upstream servers"},
		{"zero port", Config{Servers: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")}}, "non-zero port"},
		{"duplicate", Config{Servers: []netip.AddrPort{a, a}}, "listed twice"},
		{"min above max", Config{Servers: []netip.AddrPort{a}, MinTTL: time.Hour, MaxTTL: time.Minute}, "min TTL"},
		{"min above max negative", Config{Servers: []netip.AddrPort{a}, MinTTL: time.Hour, MaxNegTTL: time.Minute}, "max negative TTL"},
		{"negative in-flight", Config{Servers: []netip.AddrPort{a}, MaxInFlight: -1}, "negative"},
		{"ok", Config{Servers: []netip.AddrPort{a}}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f, err := New(tc.cfg)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				defer f.Close()
				c := f.cfg
				if c.Timeout != DefaultTimeout || c.AttemptTimeout != DefaultAttemptTimeout || c.MaxInFlight != DefaultMaxInFlight ||
					c.MinTTL != DefaultMinTTL || c.MaxTTL != DefaultMaxTTL || c.MaxNegTTL != DefaultMaxNegTTL ||
					c.StaleTTL != DefaultStaleTTL || c.HealthInterval != DefaultHealthInterval || f.cache == nil {
					t.Errorf("defaults not applied: %+v", c)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("New: %v, want error containing %q", err, tc.wantErr)
			}
		})
	}
	if c := NewConfig(a); !c.Prefetch || c.CacheSize != DefaultCacheSize {
		t.Errorf("NewConfig: %+v, want prefetch on and default cache size", c)
	}
}

// TestDeadAddr: the refused address stays refused for the whole test. The port is
// held, so no other socket of a test running beside us can take it and swallow the
// queries (which then time out instead of being refused), and a datagram sent there
// still gets ICMP port unreachable.
func TestDeadAddr(t *testing.T) {
	a := deadAddr(t)
	if pc, err := net.ListenPacket("udp", a.String()); err == nil {
		pc.Close()
		t.Fatalf("another socket could bind %s: the refused port is not held", a)
	}
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(a))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("read after a send to %s: %v, want ECONNREFUSED", a, err)
	}
}
