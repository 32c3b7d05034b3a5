package agent

// Process tuning lives here, in one place: the Go runtime's settings
// (GOGC, the memory limit, GOMAXPROCS) are the process's, and the
// libraries the agent wires (the resolver among them) leave them alone.

import (
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
)

// defaultGCPercent is the agent's GOGC when the environment sets none.
// The agent's heap is mostly its name table, which lives as long as the
// process; its query path does not allocate, and a table update leaves a
// few kilobytes of garbage (the table's maps are sharded 4096 ways). So
// collecting at 1.25x the live heap instead of 2x costs little CPU under
// churn and keeps a node's peak memory close to what the table needs
// (bench/RESULTS.md, "Memory at 100k Services", has the peaks and the
// collections at GOGC 50 and 25; make bench reports the peak).
const defaultGCPercent = 25

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

// tuneGC sets GOGC (unless the environment does) and the Go memory limit
// from the container's limit (unless GOMEMLIMIT is in the environment,
// which takes precedence).
func tuneGC(c *Config, log *slog.Logger) {
	if _, set := os.LookupEnv("GOGC"); !set {
		debug.SetGCPercent(defaultGCPercent)
	}
	if v, set := os.LookupEnv("GOMEMLIMIT"); set {
		log.Info("Go memory limit from GOMEMLIMIT", "gomemlimit", v)
		return
	}
	if lim := goMemLimit(c.MemoryLimit, c.MemoryLimitRatio); lim > 0 {
		debug.SetMemoryLimit(lim)
		log.Info("Go memory limit", "gomemlimit_bytes", lim, "memory_limit_bytes", c.MemoryLimit, "ratio", c.MemoryLimitRatio)
	}
}

// tuneProcs raises GOMAXPROCS to the resolver's blocking readers + 1 (see
// resolver.Config.OnReaders), so that one scheduler slot stays free for
// everything else. It never lowers it.
func tuneProcs(blockingReaders int, log *slog.Logger) {
	if blockingReaders == 0 {
		return
	}
	if want := blockingReaders + 1; runtime.GOMAXPROCS(0) < want {
		runtime.GOMAXPROCS(want)
		log.Debug("GOMAXPROCS raised for the resolver's blocking readers", "gomaxprocs", want)
	}
}
