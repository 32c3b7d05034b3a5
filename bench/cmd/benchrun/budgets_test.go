//go:build linux

package main

import (
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// The budgets lane judges each of the targets on its own.
func TestBudgetTargets(t *testing.T) {
	probe := func(p99 time.Duration, failed, lost int) *dnsfake.Probe {
		p := &dnsfake.Probe{Failed: failed, Lost: lost}
		for range 100 {
			p.Latencies = append(p.Latencies, p99)
		}
		return p
	}
	base := budgetPhase{quiet: probe(time.Millisecond, 0, 0), hwm: 100 << 20}
	for _, tc := range []struct {
		name string
		loud budgetPhase
		want [4]bool
	}{
		{"all met", budgetPhase{quiet: probe(1100*time.Microsecond, 0, 0), upRate: 520, hwm: 105 << 20}, [4]bool{true, true, true, true}},
		{"p99 1.3x", budgetPhase{quiet: probe(1300*time.Microsecond, 0, 0), upRate: 500, hwm: 100 << 20}, [4]bool{false, true, true, true}},
		{"one timeout", budgetPhase{quiet: probe(time.Millisecond, 0, 1), upRate: 500, hwm: 100 << 20}, [4]bool{true, false, true, true}},
		{"one SERVFAIL", budgetPhase{quiet: probe(time.Millisecond, 1, 0), upRate: 500, hwm: 100 << 20}, [4]bool{true, false, true, true}},
		{"rate 6% over", budgetPhase{quiet: probe(time.Millisecond, 0, 0), upRate: 530, hwm: 100 << 20}, [4]bool{true, true, false, true}},
		{"rate 6% under", budgetPhase{quiet: probe(time.Millisecond, 0, 0), upRate: 470, hwm: 100 << 20}, [4]bool{true, true, false, true}},
		{"memory 1.2x", budgetPhase{quiet: probe(time.Millisecond, 0, 0), upRate: 500, hwm: 120 << 20}, [4]bool{true, true, true, false}},
	} {
		// The p99 windows see the loaded phase's latencies, and no failure.
		got := budgetTargets(500, base, tc.loud, quietP99{alone: base.quiet, beside: &dnsfake.Probe{Latencies: tc.loud.quiet.Latencies}})
		for i, g := range got {
			if g.ok != tc.want[i] {
				t.Errorf("%s: %q (%s): pass %v, want %v", tc.name, g.name, g.measured, g.ok, tc.want[i])
			}
		}
	}
}

// The quiet p99 is judged over the alternating windows, not the phases, and a
// timeout in a window fails the no-failure target.
func TestBudgetTargetsJudgeTheP99OverTheWindows(t *testing.T) {
	probe := func(p99 time.Duration, lost int) *dnsfake.Probe {
		p := &dnsfake.Probe{Lost: lost}
		for range 100 {
			p.Latencies = append(p.Latencies, p99)
		}
		return p
	}
	base := budgetPhase{quiet: probe(time.Millisecond, 0), hwm: 100 << 20}
	loud := budgetPhase{quiet: probe(5*time.Millisecond, 0), upRate: 500, hwm: 100 << 20}
	got := budgetTargets(500, base, loud, quietP99{alone: probe(2*time.Millisecond, 0), beside: probe(2200*time.Microsecond, 1)})
	if !got[0].ok || got[1].ok {
		t.Errorf("windows 1.1x with a timeout, phases 5x: p99 %v (%s), no failure %v (%s); want the p99 met (the windows') and the no-failure target not",
			got[0].ok, got[0].measured, got[1].ok, got[1].measured)
	}
}

// Where the kernel stamped each answer's arrival in the quiet workload's
// socket, the p99 target is judged on those times: what the client's own
// wake-up adds after its answer arrived (its CPU is shared with the noisy
// sender) is shown beside it, not judged.
func TestBudgetTargetsJudgeTheP99AtTheAnswersArrival(t *testing.T) {
	probe := func(seen, arrived time.Duration) *dnsfake.Probe {
		p := &dnsfake.Probe{}
		for range 100 {
			p.Latencies = append(p.Latencies, seen)
			p.Arrivals = append(p.Arrivals, arrived)
		}
		return p
	}
	base := budgetPhase{quiet: probe(time.Millisecond, 500*time.Microsecond), hwm: 100 << 20}
	loud := budgetPhase{quiet: probe(time.Millisecond, 500*time.Microsecond), upRate: 500, hwm: 100 << 20}
	for _, tc := range []struct {
		name          string
		alone, beside *dnsfake.Probe
		want          bool
	}{
		{"arrivals 1.1x, the client's wake-up 3x", probe(time.Millisecond, 500*time.Microsecond), probe(3*time.Millisecond, 550*time.Microsecond), true},
		{"arrivals 2x, the client's wake-up 1x", probe(time.Millisecond, 500*time.Microsecond), probe(time.Millisecond, time.Millisecond), false},
	} {
		got := budgetTargets(500, base, loud, quietP99{alone: tc.alone, beside: tc.beside})
		if got[0].ok != tc.want {
			t.Errorf("%s: %q (%s): pass %v, want %v", tc.name, got[0].name, got[0].measured, got[0].ok, tc.want)
		}
	}
}
