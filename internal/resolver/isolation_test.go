package resolver

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

// During 10,000 simultaneous distinct slow (2 s) upstream misses from 100
// clients, in-table queries are all answered, and every flood query gets an answer
// within 5 s: the upstream's, or at once a SERVFAIL/REFUSED when over a bound.
func TestSlowMissesDoNotStarveTable(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	ts.up.SetDelay(2 * time.Second)
	const clients, perClient = 100, 100

	// In-table prober: one query at a time, from its own address, until the flood ends.
	stop := make(chan struct{})
	probed := make(chan *dnsfake.Probe, 1)
	go func() {
		p, err := dnsfake.Prober(ts.addr, "productpage.ns1.svc.cluster.local.", time.Second, 2*time.Millisecond, stop)
		if err != nil {
			t.Error(err)
		}
		probed <- p
	}()
	flood, err := dnsfake.FloodUDP(mustAddrPort(ts.addr), 1, clients, perClient,
		func(c, i int) string { return fmt.Sprintf("slow%d-%d.example.net.", c, i) }, 5*time.Second)
	close(stop)
	p := <-probed
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("flood of %d slow misses from %d clients: answered within 5 s by rcode %v, unanswered %d", clients*perClient, clients, flood.Rcodes, flood.Unanswered)
	t.Logf("in-table queries during the flood: %d answered, %d lost; p50 %s, p99 %s, max %s",
		len(p.Latencies), p.Lost, p.Percentile(0.5).Round(time.Microsecond), p.Percentile(0.99).Round(time.Microsecond), p.Percentile(1).Round(time.Microsecond))
	if p.Lost != 0 || len(p.Latencies) < 50 {
		t.Errorf("in-table queries: %d answered, %d lost during the flood; want all answered", len(p.Latencies), p.Lost)
	}
	if flood.Unanswered != 0 {
		t.Errorf("%d flood queries got no answer within 5 s; want an answer or a fast SERVFAIL/REFUSED for each", flood.Unanswered)
	}
}

func mustAddrPort(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }

// One client cannot take every pending slot: over its share (MaxPendingPerClient) it
// gets REFUSED at once, and over the total bound everyone gets SERVFAIL at once.
func TestPendingBounds(t *testing.T) {
	ts := startServer(t, testFile(), func(c *Config) { c.MaxPendingPerClient = 20; c.MaxPending = 30 })
	ts.up.SetDelay(time.Second)
	// Rejections come back at once, before the upstream's one-second answers.
	send := func(src string, n int, prefix string) map[int]int {
		rcodes, _ := burst(t, ts.addr, src, prefix, n, 500*time.Millisecond)
		return rcodes
	}
	if got := send("127.0.3.1", 25, "a"); got[dns.RcodeRefused] != 5 || len(got) != 1 {
		t.Errorf("25 slow misses from one client with a share of 20: fast answers %v, want 5 REFUSED", got)
	}
	if got := send("127.0.3.2", 15, "b"); got[dns.RcodeServerFailure] != 5 || len(got) != 1 {
		t.Errorf("15 more from another client with 30 in total: fast answers %v, want 5 SERVFAIL", got)
	}
	if got := metrictest.Value(t, ts.reg, "meshdns_dns_overload_total", "limit", "client"); got != 5 {
		t.Errorf("overload{client} = %v, want 5", got)
	}
	if got := metrictest.Value(t, ts.reg, "meshdns_dns_overload_total", "limit", "total"); got != 5 {
		t.Errorf("overload{total} = %v, want 5", got)
	}
}
