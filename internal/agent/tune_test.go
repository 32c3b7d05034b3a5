package agent

import (
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The Go memory limit follows the container's memory limit (the DaemonSet's
// resourceFieldRef in $MESHDNS_MEMORY_LIMIT) times the ratio; GOMEMLIMIT in
// the environment takes precedence; no limit sets none.
func TestMemoryLimitFromContainerLimit(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(prev) })
	unsetEnv(t, "GOMEMLIMIT")
	for _, tc := range []struct {
		name, env string
		args      []string
		want      int64
		wantErr   string
	}{
		{"256Mi from the env", "268435456", nil, 241591910, ""}, // 0.9 of 256 MiB
		{"384Mi, ratio 0.8", "402653184", []string{"--memory-limit-ratio", "0.8"}, 322122547, ""},
		{"flag over env", "268435456", []string{"--memory-limit", "1073741824"}, 966367641, ""},
		{"no limit", "", nil, prev, ""},
		{"not bytes", "256Mi", nil, 0, "want a number of bytes"},
		{"ratio 0", "268435456", []string{"--memory-limit-ratio", "0"}, 0, "--memory-limit-ratio"},
		{"ratio above 1", "268435456", []string{"--memory-limit-ratio", "1.5"}, 0, "--memory-limit-ratio"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			debug.SetMemoryLimit(prev)
			t.Setenv(MemoryLimitEnv, tc.env)
			c, err := parseRun(t, tc.args...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tuneMemoryLimit(c, slog.New(slog.DiscardHandler))
			if got := debug.SetMemoryLimit(-1); got != tc.want {
				t.Errorf("Go memory limit %d, want %d", got, tc.want)
			}
		})
	}
	t.Run("GOMEMLIMIT wins", func(t *testing.T) {
		debug.SetMemoryLimit(prev)
		t.Setenv("GOMEMLIMIT", "100MiB")
		t.Setenv(MemoryLimitEnv, "268435456")
		c, err := parseRun(t)
		if err != nil {
			t.Fatal(err)
		}
		tuneMemoryLimit(c, slog.New(slog.DiscardHandler))
		if got := debug.SetMemoryLimit(-1); got != prev {
			t.Errorf("Go memory limit %d: set although GOMEMLIMIT is in the environment", got)
		}
	})
}

// unsetEnv removes name for the test, restoring it after.
func unsetEnv(t *testing.T, name string) {
	t.Helper()
	if v, ok := os.LookupEnv(name); ok {
		t.Setenv(name, v) // registers the restore
		os.Unsetenv(name)
	}
}

func TestTuneProcsRaisesNeverLowers(t *testing.T) {
	prev := runtime.GOMAXPROCS(1)
	t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
	log := slog.New(slog.DiscardHandler)
	tuneProcs(0, log)
	if got := runtime.GOMAXPROCS(0); got != 1 {
		t.Errorf("GOMAXPROCS %d after no blocking readers, want 1 (unchanged)", got)
	}
	tuneProcs(3, log)
	if got := runtime.GOMAXPROCS(0); got != 4 {
		t.Errorf("GOMAXPROCS %d after 3 blocking readers, want 4", got)
	}
	tuneProcs(1, log)
	if got := runtime.GOMAXPROCS(0); got != 4 {
		t.Errorf("GOMAXPROCS %d after 1 blocking reader, want 4 (never lowered)", got)
	}
}

// The resolver's readers get a scheduler slot each and one more, rounded up to
// a count for which the collector's pacer runs whole dedicated mark workers and
// no fractional one (which would take a preempted reader's slot).
func TestProcsForLeavesNoFractionalMarkWorker(t *testing.T) {
	for _, c := range []struct{ readers, procs int }{
		{1, 4}, {2, 4}, {3, 4}, {4, 5}, {5, 7}, {6, 7}, {7, 8}, {15, 16}, {63, 64},
	} {
		if got := procsFor(c.readers); got != c.procs {
			t.Errorf("procsFor(%d) = %d, want %d", c.readers, got, c.procs)
		}
	}
	for procs, want := range map[int]bool{1: true, 2: true, 3: true, 4: false, 5: false, 6: true, 7: false, 8: false, 9: false, 10: false, 11: false} {
		if got := fractionalMarkWorker(procs); got != want {
			t.Errorf("fractionalMarkWorker(%d) = %v, want %v", procs, got, want)
		}
	}
}

// gcPercent reads GOGC without setting it.
func gcPercent() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(s[0].Value.Uint64())
}

// numGC is how many collection cycles have completed.
func numGC() uint32 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.NumGC
}

// While a large table change is made the collector is held back (GOGC
// raised once, however many beginnings: the file's read and the store's
// apply, or two sources), until every beginning has had its end; then a
// collection runs and GOGC is what it was. A GOGC from the environment is
// left alone.
func TestGCHeldDuringALargeChange(t *testing.T) {
	unsetEnv(t, "GOGC")
	prev := debug.SetGCPercent(25)
	t.Cleanup(func() { debug.SetGCPercent(prev) })
	g := newGCControl()
	g.largeChange(true) // the file's read
	g.largeChange(true) // the store's apply
	if got := gcPercent(); got != largeChangeGCPercent {
		t.Fatalf("GOGC %d while a large change is made, want %d", got, largeChangeGCPercent)
	}
	before := numGC()
	g.largeChange(false) // the read's end: the apply goes on
	if got := gcPercent(); got != largeChangeGCPercent {
		t.Errorf("GOGC %d after one of two ends, want %d still", got, largeChangeGCPercent)
	}
	g.largeChange(false) // the publish
	testenv.Eventually(t, 5*time.Second, func() bool { return numGC() > before && gcPercent() == 25 },
		"after the large change: want a collection and GOGC 25 as before")

	t.Setenv("GOGC", "40")
	debug.SetGCPercent(40)
	g = newGCControl()
	g.largeChange(true)
	if got := gcPercent(); got != 40 {
		t.Errorf("GOGC %d while a large change is applied, want 40 (the environment's)", got)
	}
	before = numGC()
	g.largeChange(false)
	// Its collection, before the next test counts cycles.
	testenv.Eventually(t, 5*time.Second, func() bool { return numGC() > before && gcPercent() == 40 },
		"after the large change: want a collection and GOGC 40 still")
}

// A change that rewrites the whole table allocates a second table of the
// live heap's size while the first is still live, on top of the garbage the
// steady state left (up to defaultGCPercent of the live heap). Held, it goes
// through with no collection cycle, and the collection at its end is the
// only one: each cycle makes the resolver's reader wait behind a mark
// worker.
func TestGCHoldLetsARewriteOfTheWholeHeapThroughWithoutACycle(t *testing.T) {
	unsetEnv(t, "GOGC")
	prev := debug.SetGCPercent(defaultGCPercent)
	t.Cleanup(func() { debug.SetGCPercent(prev) })
	const size = 32 << 20
	old := allocateTable(size)
	runtime.GC()
	_ = allocateTable(size * defaultGCPercent / 100 / 2) // garbage, short of a cycle
	before := numGC()

	g := newGCControl()
	g.largeChange(true)
	next := allocateTable(size)
	during := numGC() - before
	runtime.KeepAlive(old) // the old table is live until the new one is published
	g.largeChange(false)
	testenv.Eventually(t, 5*time.Second, func() bool { return numGC() > before+during && gcPercent() == defaultGCPercent },
		"after the change: want its collection and GOGC %d again", defaultGCPercent)
	if during != 0 {
		t.Errorf("%d collection cycles while a rewrite of the whole heap was made, want none", during)
	}
	runtime.KeepAlive(next)
}

// allocateTable allocates about size bytes as a table does: small objects
// that point to each other.
func allocateTable(size int) []*tableNode {
	nodes := make([]*tableNode, 0, size/int(unsafe.Sizeof(tableNode{})))
	var prev *tableNode
	for range cap(nodes) {
		n := &tableNode{next: prev}
		nodes = append(nodes, n)
		prev = n
	}
	return nodes
}

type tableNode struct {
	next *tableNode
	_    [120]byte
}

func TestGCPercentKeepsHeadroomOnASmallHeap(t *testing.T) {
	for _, tc := range []struct {
		live uint64
		want int
	}{
		{0, maxGCPercent},
		{256 << 10, maxGCPercent},
		{1 << 20, 400},
		{3 << 20, 134},
		{4 << 20, 100},
		{16 << 20, 25},
		{512 << 20, defaultGCPercent},
	} {
		if got := gcPercentFor(tc.live); got != tc.want {
			t.Errorf("gcPercentFor(%d) = %d, want %d", tc.live, got, tc.want)
		}
	}
}

// After each collection GOGC follows the live heap: on a small one the goal
// stays minHeapHeadroom above it, on a large one GOGC is defaultGCPercent; a
// hold during a large change wins over it, and after stop GOGC stays.
func TestGCControlFollowsTheLiveHeap(t *testing.T) {
	unsetEnv(t, "GOGC")
	prev := debug.SetGCPercent(100)
	t.Cleanup(func() { debug.SetGCPercent(prev) })
	g := newGCControl()
	g.start()
	t.Cleanup(g.stop)
	runtime.GC()
	small := liveHeap()
	if small >= 16<<20 {
		t.Skipf("the test process's live heap is already %d bytes", small)
	}
	testenv.Eventually(t, 5*time.Second, func() bool {
		runtime.GC()
		return gcPercent() == gcPercentFor(liveHeap()) && gcPercent() > defaultGCPercent
	},
		"on a live heap of %d bytes: want GOGC %d", small, gcPercentFor(small))

	table := allocateTable(64 << 20)
	testenv.Eventually(t, 5*time.Second, func() bool {
		runtime.GC()
		runtime.KeepAlive(table)
		return gcPercent() == defaultGCPercent
	}, "on a live heap of 64 MiB more: want GOGC %d", defaultGCPercent)

	g.largeChange(true) // the table becomes garbage: a rewrite's old table
	runtime.GC()
	runtime.GC()
	if got := gcPercent(); got != largeChangeGCPercent {
		t.Errorf("GOGC %d during a large change, after collections, want %d", got, largeChangeGCPercent)
	}
	g.largeChange(false)
	testenv.Eventually(t, 5*time.Second, func() bool {
		runtime.GC()
		return gcPercent() == gcPercentFor(liveHeap()) && gcPercent() > defaultGCPercent
	},
		"after the large change, the table garbage: want GOGC for the small heap again")

	g.stop()
	debug.SetGCPercent(77)
	runtime.GC()
	runtime.GC()
	if got := gcPercent(); got != 77 {
		t.Errorf("GOGC %d after stop and collections, want 77 left alone", got)
	}
}
