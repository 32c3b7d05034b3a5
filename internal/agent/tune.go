package agent

// Process tuning lives here, in one place: the Go runtime's settings
// (GOGC, the memory limit, GOMAXPROCS) are the process's, and the
// libraries the agent wires (the resolver among them) leave them alone.

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"sync"
)

// defaultGCPercent is the agent's GOGC when the environment sets none.
// The agent's heap is mostly its name table, which lives as long as the
// process; its query path does not allocate for table answers and cache
// hits, and a table update leaves a few kilobytes of garbage (the table's
// maps are sharded 4096 ways). So collecting at 1.25x the live heap instead
// of 2x costs little CPU under churn and keeps a node's peak memory close to
// what the table needs (bench/RESULTS.md, "Memory at 100k Services", has the
// peaks and the collections at GOGC 50 and 25; make bench reports the peak).
// On a small heap minHeapHeadroom takes over (gcPercentFor).
const defaultGCPercent = 25

// minHeapHeadroom is the least the collector's goal stays above the live
// heap: the Go runtime's own minimum goal at GOGC 100 (4 MiB), which GOGC
// 25 alone would shrink to 1 MiB. On a node with few names the live heap
// is a few megabytes, and forwarded queries allocate (the resolution, its
// attempt, the parsed reply, the cache entry): at defaultGCPercent alone a
// cycle started for every megabyte of them, and each cycle's mark worker
// can take a resolver reader's scheduler slot (procsFor) and delay the
// queries queued behind it (bench/RESULTS.md, section 17). The cost is at
// most these 4 MiB of peak memory, whatever the table's size.
const minHeapHeadroom = 4 << 20

// maxGCPercent bounds gcPercentFor on a near-empty heap.
const maxGCPercent = 1000

// gcPercentFor is GOGC for a live heap of live bytes: defaultGCPercent, or
// what leaves minHeapHeadroom above live when that is more.
func gcPercentFor(live uint64) int {
	if live == 0 {
		return maxGCPercent
	}
	p := (uint64(minHeapHeadroom)*100 + live - 1) / live
	return int(min(max(p, defaultGCPercent), maxGCPercent))
}

// MemoryLimitEnv is where the DaemonSet puts the container's memory limit,
// in bytes (a resourceFieldRef of limits.memory): the default of
// --memory-limit.
const MemoryLimitEnv = "MESHDNS_MEMORY_LIMIT"

// DefaultMemoryLimitRatio is the share of --memory-limit the Go runtime's
// soft memory limit is set to: the heap is collected harder as it nears it,
// and the rest is left for what the runtime does not count (stacks of the
// OS, page tables, fragmentation). 0.9 of the DaemonSet's 256Mi is 230 MiB.
const DefaultMemoryLimitRatio = 0.9

// parseMemoryLimit reads --memory-limit: bytes, as a resourceFieldRef gives
// them; "" is none.
func parseMemoryLimit(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("--memory-limit %q (or $%s): want a number of bytes", s, MemoryLimitEnv)
	}
	return v, nil
}

// goMemLimit is the soft memory limit the agent sets: ratio of limit, or 0
// (none) without a limit.
func goMemLimit(limit int64, ratio float64) int64 {
	if limit <= 0 {
		return 0
	}
	return int64(float64(limit) * ratio)
}

// tuneMemoryLimit sets the Go memory limit from the container's limit
// (unless GOMEMLIMIT is in the environment, which takes precedence). GOGC is
// gcControl's.
func tuneMemoryLimit(c *Config, log *slog.Logger) {
	if v, set := os.LookupEnv("GOMEMLIMIT"); set {
		log.Info("Go memory limit from GOMEMLIMIT", "gomemlimit", v)
		return
	}
	if lim := goMemLimit(c.MemoryLimit, c.MemoryLimitRatio); lim > 0 {
		debug.SetMemoryLimit(lim)
		log.Info("Go memory limit", "gomemlimit_bytes", lim, "memory_limit_bytes", c.MemoryLimit, "ratio", c.MemoryLimitRatio)
	}
}

// largeChangeGCPercent is GOGC while a large table change is made: the
// collector starts no cycle before the heap is three times what the last one
// found live. A rewrite of every entry needs about twice the live heap and a
// quarter (the old table, a new one of its size, and the garbage
// defaultGCPercent left before it), so it goes through with no cycle, and
// the collection at its end is the only one. At 100 one or two cycles ran
// during the rewrite, and the query tail with them (bench/RESULTS.md, section
// 11). A container's memory limit still starts cycles (the Go memory limit,
// tuneMemoryLimit).
const largeChangeGCPercent = 200

// gcControl sets GOGC, unless the environment does: after each collection
// gcPercentFor the heap it found live, and largeChangeGCPercent while a
// large name table change is made.
//
// Its largeChange is both the file source's hook (the file's read, which
// decodes the changed entries into new hosts: filesource.Options.LargeChange)
// and the name store's (its apply, which copies the shards that hold them,
// and the publish: names.Config.LargeChange); the hold lasts until every
// beginning has had its end. While such a change is made, nearly all it
// allocates stays, so a cycle then frees little: it only costs the resolver
// a wait for its scheduler slot (bench/RESULTS.md, section 11). Once the
// change is published the old table is garbage, and collecting it at once
// lets the next change start from the live heap, not on top of the old
// table.
type gcControl struct {
	mu      sync.Mutex
	fromEnv bool // GOGC is the environment's: leave it
	depth   int  // beginnings without their end
	raised  bool // GOGC is largeChangeGCPercent, until collect puts percent back
	percent int  // GOGC outside a hold
	stopped bool
}

func newGCControl() *gcControl {
	_, set := os.LookupEnv("GOGC")
	return &gcControl{fromEnv: set, percent: defaultGCPercent}
}

// start sets GOGC for the heap live now and follows each collection's
// live heap until stop.
func (g *gcControl) start() {
	if g.fromEnv {
		return
	}
	g.mu.Lock()
	g.percent = gcPercentFor(liveHeap())
	debug.SetGCPercent(g.percent)
	g.mu.Unlock()
	g.armCycleHook()
}

// stop leaves GOGC as it is from now on.
func (g *gcControl) stop() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.stopped = true
}

// gcSentinel is garbage whose finalizer runs once per collection cycle.
type gcSentinel struct{ g *gcControl }

// armCycleHook makes the next collection call afterCycle (and arm again).
func (g *gcControl) armCycleHook() {
	runtime.SetFinalizer(&gcSentinel{g: g}, func(s *gcSentinel) {
		if s.g.afterCycle() {
			s.g.armCycleHook()
		}
	})
}

// afterCycle sets percent for the live heap the last collection found
// (GOGC too, outside a hold). It reports whether to go on. It runs only
// when start armed it, which it does not with GOGC from the environment.
func (g *gcControl) afterCycle() bool {
	live := liveHeap()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return false
	}
	if p := gcPercentFor(live); p != g.percent {
		g.percent = p
		if !g.raised {
			debug.SetGCPercent(p)
		}
	}
	return true
}

// liveHeap is the heap the last collection marked live, in bytes.
func liveHeap() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// largeChange is names.Config.LargeChange and filesource.Options.LargeChange.
func (g *gcControl) largeChange(begins bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if begins {
		if g.depth == 0 && !g.raised && !g.fromEnv {
			debug.SetGCPercent(largeChangeGCPercent)
			g.raised = true
		}
		g.depth++
		return
	}
	if g.depth > 0 {
		if g.depth--; g.depth > 0 {
			return
		}
	}
	go g.collect()
}

// collect runs a collection, then puts GOGC back unless a new hold began
// meanwhile. Collecting first, with GOGC still raised, is one cycle: GOGC
// put back first would start one at once (the heap, the old table in it, is
// over the goal), and the collection asked for would be a second.
func (g *gcControl) collect() {
	runtime.GC()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.depth == 0 && g.raised {
		debug.SetGCPercent(g.percent)
		g.raised = false
	}
}

// tuneProcs raises GOMAXPROCS to procsFor(blockingReaders) (see
// resolver.Config.OnReaders). It never lowers it.
func tuneProcs(blockingReaders int, log *slog.Logger) {
	if blockingReaders == 0 {
		return
	}
	if want := procsFor(blockingReaders); runtime.GOMAXPROCS(0) < want {
		runtime.GOMAXPROCS(want)
		log.Debug("GOMAXPROCS raised for the resolver's blocking readers", "gomaxprocs", want)
	}
}

// procsFor is the GOMAXPROCS for the resolver's blocking UDP readers: a
// scheduler slot (P) per reader and one for everything else, rounded up to a
// count for which the collector runs no fractional mark worker. Any P starts
// a fractional worker when it next schedules while under its share, and a
// reader's P schedules each time the runtime preempts the reader (every
// 10 ms: a raw system call looks like running code): the reader then waited
// for the worker's slice, milliseconds, all through a large table change's
// collections (bench/RESULTS.md, "The tail during a rewrite of every
// address"). A dedicated worker can still take a preempted reader's P at
// the start of a cycle, once per cycle.
func procsFor(blockingReaders int) int {
	n := blockingReaders + 1
	for fractionalMarkWorker(n) {
		n++
	}
	return n
}

// fractionalMarkWorker reports whether the Go runtime's collector gives
// procs Ps a fractional mark worker. Its pacer (runtime/mgcpacer.go,
// startCycle) gives a quarter of the Ps to marking, rounded to whole
// dedicated workers, and makes up a rounding error of more than 30% with a
// fractional worker: with 1, 2, 3 and 6 Ps.
func fractionalMarkWorker(procs int) bool {
	share := 0.25 * float64(procs)
	dedicated := math.Floor(share + 0.5)
	return math.Abs(dedicated/share-1) > 0.3
}

// readerNice is the nice value of the resolver's UDP reader threads
// (resolver.Config.ReaderNice): a query's wake-up preempts the agent's other
// threads (the collector's workers, a reload, the Kubernetes watches)
// where they share a CPU. The readers do a few microseconds of work per
// query; the rest of the agent keeps the process's priority.
const readerNice = -5
