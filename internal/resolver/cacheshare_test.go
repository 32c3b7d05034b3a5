package resolver

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// lockstep asks server each name from src, one query at a time, and returns the
// answers' rcodes.
func lockstep(t *testing.T, server, src string, names []string) map[int]int {
	t.Helper()
	c := dns.Client{Net: "udp", Timeout: 2 * time.Second, Dialer: &net.Dialer{LocalAddr: &net.UDPAddr{IP: net.ParseIP(src)}}}
	conn, err := c.Dial(server)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rcodes := map[int]int{}
	for i, n := range names {
		m := query(n, dns.TypeA)()
		m.Id = uint16(i)
		resp, _, err := c.ExchangeWithConn(m, conn)
		if err != nil {
			t.Fatalf("%s from %s: %v", n, src, err)
		}
		rcodes[resp.Rcode]++
	}
	return rcodes
}

// A workload's misses fill at most its share of the answer cache: a noisy one asking
// thousands of distinct names evicts its own oldest answers, and a quiet workload's
// cached answers are still answered from the cache after the flood, without a query
// upstream.
func TestNoisyWorkloadKeepsToItsCacheShare(t *testing.T) {
	up, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: upstreamAnswer(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(up.Close)
	const share = 32 << 10 // ~80 denials
	freg := prometheus.NewRegistry()
	fwd := newForwarder(t, up.Addr.String(), freg, func(fcfg *upstream.Config) {
		fcfg.CacheBytes = 256 << 10 // ~600
		fcfg.CacheWorkloadBytes = share
	})
	ts := startServer(t, testFile(), func(c *Config) { c.Forwarder = fwd })

	var quiet, noisy []string
	for i := range 20 {
		quiet = append(quiet, fmt.Sprintf("q%d.example.net.", i))
	}
	for i := range 2000 {
		noisy = append(noisy, fmt.Sprintf("n%d.example.net.", i))
	}
	if rc := lockstep(t, ts.addr, "127.0.4.21", quiet); rc[dns.RcodeNameError] != len(quiet) {
		t.Fatalf("quiet workload: rcodes %v, want %d NXDOMAIN", rc, len(quiet))
	}
	quietBytes := metrictest.Value(t, freg, "meshdns_cache_bytes")
	if rc := lockstep(t, ts.addr, "127.0.4.22", noisy); rc[dns.RcodeNameError] != len(noisy) {
		t.Fatalf("noisy workload: rcodes %v, want %d NXDOMAIN", rc, len(noisy))
	}
	used := metrictest.Value(t, freg, "meshdns_cache_bytes")
	if used > quietBytes+share {
		t.Errorf("cache %.0f bytes after the flood: more than the quiet workload's %.0f and one share (%d)", used, quietBytes, share)
	}
	before := up.Count()
	if rc := lockstep(t, ts.addr, "127.0.4.21", quiet); rc[dns.RcodeNameError] != len(quiet) {
		t.Fatalf("quiet workload again: rcodes %v, want %d NXDOMAIN", rc, len(quiet))
	}
	if n := up.Count() - before; n != 0 {
		t.Errorf("the quiet workload's %d names again after the flood sent %d queries upstream, want 0 (cached)", len(quiet), n)
	}
	if ev := metrictest.Value(t, freg, "meshdns_cache_workload_evictions_total"); ev == 0 {
		t.Error("meshdns_cache_workload_evictions_total = 0 after a flood over the share")
	}
}
