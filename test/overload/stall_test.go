package overload

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// shortTTL answers as nxOrAnswers, with the external names' records at TTL 1: the
// agent caches them for its minimum lifetime (5 s), so during a 10 s stall they
// expire and can only be served stale.
func shortTTL(proto string, req *dns.Msg) []*dns.Msg {
	out := nxOrAnswers(proto, req)
	if strings.HasPrefix(strings.ToLower(req.Question[0].Name), "ext") {
		for _, m := range out {
			for _, rr := range m.Answer {
				rr.Header().Ttl = 1
			}
		}
	}
	return out
}

// TestUpstreamStallKeepsTableAnswers: the upstream stops answering for 10 s while a
// noisy workload sends 20,000 qps of unique misses. The quiet workload's table answers
// keep their latency (p99 within 10x that of the same run's phase without the stall,
// none lost or failed): they never queue behind the stalled upstream. Its external
// names, expired in the cache meanwhile, are served stale with the cached address,
// never SERVFAIL or lost.
func TestUpstreamStallKeepsTableAnswers(t *testing.T) {
	const budget = 500
	stall := envDuration(t, "MESHDNS_STALL", 10*time.Second)
	a := startAgentWith(t, dnsfake.RateLimited(shortTTL, 2000, 2*time.Millisecond), "--log-level", "warn",
		"--workload-qps", strconv.Itoa(budget), "--workload-max-pending", "128")
	external := []string{"ext1.example.org.", "ext2.example.org.", "ext3.example.org."}
	phase := func(stalled bool) *dnsfake.Probe {
		l := startLoad(t, a, nxName)
		if stalled {
			thaw := a.up.Freeze()
			time.Sleep(stall) // the stall's length: the load runs meanwhile
			thaw()
		} else {
			time.Sleep(stall)
		}
		noisy, p := l.stop()
		if noisy != nil {
			t.Logf("noisy (stalled %v): sent %d, answers %v", stalled, noisy.Sent, noisy.Answers)
		}
		if p == nil {
			t.Fatal("the quiet workload's prober failed")
		}
		return p
	}
	base := phase(false)
	staleBefore, _ := a.seriesValue(t, `meshdns_cache_hits_total{type="stale"}`) // absent: none yet
	stalled := phase(true)
	staleAfter, _ := a.seriesValue(t, `meshdns_cache_hits_total{type="stale"}`)
	staleHits := staleAfter - staleBefore
	if a.proc.Exited() {
		t.Fatalf("the agent died:\n%s", tail(a.proc.Log.String(), 40))
	}
	for _, r := range []struct {
		what string
		p    *dnsfake.Probe
	}{{"without the stall", base}, {"during the stall", stalled}} {
		tb := r.p.ByName[meshName]
		t.Logf("%s: table %d answered, %d failed, %d lost, p50 %s p99 %s", r.what, len(tb.Latencies), tb.Failed, tb.Lost,
			tb.Percentile(0.5).Round(time.Microsecond), tb.Percentile(0.99).Round(time.Microsecond))
		for _, n := range external {
			e := r.p.ByName[n]
			t.Logf("%s: %s %d answered, %d failed, %d lost, p50 %s p99 %s, addresses %v", r.what, n, len(e.Latencies), e.Failed, e.Lost,
				e.Percentile(0.5).Round(time.Microsecond), e.Percentile(0.99).Round(time.Microsecond), r.p.Addrs[n])
		}
	}
	tb, tbStalled := base.ByName[meshName], stalled.ByName[meshName]
	if tbStalled.Failed+tbStalled.Lost > 0 || tb.Failed+tb.Lost > 0 {
		t.Errorf("table name: %d failed, %d lost without the stall, %d failed, %d lost during it: want none", tb.Failed, tb.Lost, tbStalled.Failed, tbStalled.Lost)
	}
	if p99, bound := tbStalled.Percentile(0.99), 10*tb.Percentile(0.99); p99 > bound {
		t.Errorf("table name p99 %s during the stall, over 10x its p99 without it (%s)", p99, bound)
	}
	t.Logf("stale answers during the stall: %v", staleHits)
	if staleHits == 0 {
		t.Errorf("meshdns_cache_hits_total{type=\"stale\"} did not grow during the stall: the external names were not served stale")
	}
	for _, n := range external {
		e := stalled.ByName[n]
		if e.Failed+e.Lost > 0 || len(e.Latencies) == 0 {
			t.Errorf("%s during the stall: %d answered, %d failed (SERVFAIL or REFUSED), %d lost; want every one answered stale", n, len(e.Latencies), e.Failed, e.Lost)
		}
		if addrs := stalled.Addrs[n]; len(addrs) != 1 || addrs["192.0.2.1"] == 0 {
			t.Errorf("%s during the stall: answered with %v, want the cached 192.0.2.1 only", n, addrs)
		}
	}
}
