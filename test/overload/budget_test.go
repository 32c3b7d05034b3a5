package overload

import (
	"strconv"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// quietRun is what the quiet workload saw in one phase.
type quietRun struct {
	*dnsfake.Probe
	peak int64 // memory high-water mark of the agent's group in the phase
}

// TestNoisyWorkloadSpendsOnlyItsOwnBudget: with per-workload budgets, a workload
// sending 20,000 qps of unique NXDOMAIN-bound misses spends its own upstream budget and
// no more, while a quiet workload (table and external names, 200 qps) keeps every
// answer, behind an upstream that answers 2,000 qps after 2 ms and drops the rest. The
// quiet workload's latency and the agent's memory are measured alone first, then
// beside the noisy one, in the same run; the figures go to bench/RESULTS.md.
func TestNoisyWorkloadSpendsOnlyItsOwnBudget(t *testing.T) {
	const budget = 500                                         // upstream queries a second per workload
	d := envDuration(t, "MESHDNS_BUDGET_PHASE", 8*time.Second) // each phase
	a := startAgentWith(t, dnsfake.RateLimited(nxOrAnswers, 2000, 2*time.Millisecond), "--log-level", "warn",
		"--workload-qps", strconv.Itoa(budget), "--workload-max-pending", "128")
	phase := func(noisy bool) (quietRun, *dnsfake.Paced, int64) {
		upBefore := a.up.Count()
		a.cg.ResetPeak()
		var name func(int) string
		if noisy {
			name = nxName
		}
		l := startLoad(t, a, name)
		start := time.Now()
		time.Sleep(d) // the phase's length: the load runs meanwhile
		upCount := a.up.Count() - upBefore
		el := time.Since(start)
		p, q := l.stop()
		r := quietRun{Probe: q, peak: a.cg.Int("memory.max_usage_in_bytes")}
		return r, p, int64(float64(upCount) / el.Seconds())
	}
	base, _, _ := phase(false)
	loud, noisy, upRate := phase(true)
	if a.proc.Exited() {
		t.Fatalf("the agent died:\n%s", tail(a.proc.Log.String(), 40))
	}
	p99a, p99b := base.Percentile(0.99), loud.Percentile(0.99)
	t.Logf("quiet alone: %d answered, %d failed, %d lost, p50 %s p99 %s, peak memory %.1f MiB",
		len(base.Latencies), base.Failed, base.Lost, base.Percentile(0.5).Round(time.Microsecond), p99a.Round(time.Microsecond), float64(base.peak)/(1<<20))
	t.Logf("quiet beside the noisy workload: %d answered, %d failed, %d lost, p50 %s p99 %s (%.2fx alone), peak memory %.1f MiB (%.2fx)",
		len(loud.Latencies), loud.Failed, loud.Lost, loud.Percentile(0.5).Round(time.Microsecond), p99b.Round(time.Microsecond),
		float64(p99b)/float64(max(p99a, 1)), float64(loud.peak)/(1<<20), float64(loud.peak)/float64(max(base.peak, 1)))
	t.Logf("noisy: sent %d, answers %v; upstream queries %d/s with a budget of %d/s", noisy.Sent, noisy.Answers, upRate, budget)
	if loud.Failed+loud.Lost > 0 || base.Failed+base.Lost > 0 {
		t.Errorf("quiet workload: %d+%d failed or lost alone, %d+%d beside the noisy one: want every query answered",
			base.Failed, base.Lost, loud.Failed, loud.Lost)
	}
	// The noisy workload's misses reach the upstream at its budget and no faster (the
	// quiet one's external names are cached after their first answers).
	if upRate > budget*105/100+int64(float64(budget)/d.Seconds()) {
		t.Errorf("upstream queries %d/s beside a workload budget of %d/s", upRate, budget)
	}
	if noisy.Answers["REFUSED"] == 0 {
		t.Errorf("the noisy workload was never throttled: %v", noisy.Answers)
	}
}
