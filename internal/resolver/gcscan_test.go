package resolver

import (
	"runtime"
	"syscall"
	"testing"
	"time"
)

// A collection scans every goroutine's stack, which needs each goroutine
// stopped at a safe point (not a stop-the-world: one goroutine at a time, while
// the others run). Idle readers, blocked in their raw receive calls and woken
// by the runtime's preemption signal, must stop there: a whole collection takes
// milliseconds, not the seconds it took while readers went straight back into
// the kernel (the agent stalled for up to 8 s: nothing that allocates runs while
// a collection cannot finish).
//
// Judged by the context switches a collection costs the process: a count,
// which the machine's load does not blur the way it does a duration. With 8
// idle readers, 110-260 per collection here (idle, or beside three or six busy
// loops); with readers that skip the safe point (the runtime signals and yields
// until it catches them) 1,280-8,560. Durations grow with the load: the mean of
// the working version under three busy loops reached that of the broken one on
// an idle machine, so only a stall is bounded.
func TestIdleReadersLetCollectionsFinish(t *testing.T) {
	ts := startServer(t, testFile(), func(c *Config) {
		c.Listen = []string{"127.0.0.1:0", "127.0.0.2:0", "127.0.0.3:0", "127.0.0.4:0"}
	})
	time.Sleep(50 * time.Millisecond) // the readers are blocked in the kernel
	const n = 50
	var worst time.Duration
	before := usage(t)
	for range n {
		start := time.Now()
		runtime.GC()
		worst = max(worst, time.Since(start))
	}
	after := usage(t)
	switches := float64(after.Nvcsw+after.Nivcsw-before.Nvcsw-before.Nivcsw) / n
	cpu := time.Duration((after.Utime.Nano()+after.Stime.Nano())-(before.Utime.Nano()+before.Stime.Nano())) / n
	t.Logf("%d collections with %d idle readers: %.0f context switches and %v of CPU each, the longest %v",
		n, len(ts.s.udp), switches, cpu, worst)
	if switches > 600 || worst > time.Second {
		t.Errorf("collections with idle readers: %.0f context switches each (want a few hundred at most), the longest %v",
			switches, worst)
	}
}

// usage is the test process's resource usage so far.
func usage(t *testing.T) syscall.Rusage {
	t.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatalf("getrusage: %v", err)
	}
	return ru
}
