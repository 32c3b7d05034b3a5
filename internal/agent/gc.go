package agent

import (
	"log/slog"
	"os"
	"runtime/debug"
)

// defaultGCPercent is the agent's GOGC when the environment sets none.
// The agent's heap is mostly its name table, which lives as long as the
// process; its query path does not allocate, and a table update leaves a
// few kilobytes of garbage (the table's maps are sharded 4096 ways). So
// collecting at 1.25x the live heap instead of 2x costs little CPU (with
// 100k Services and 50 EndpointSlice updates/s, one collection every ~15 s)
// and keeps a node's peak memory close to what the table needs: 100k
// Services peaked at 265 MiB with GOGC=50 and 239 MiB with 25 (by hand,
// bench/kube's population and churn; make bench reports the peak).
// GOGC and GOMEMLIMIT in the environment take precedence (the DaemonSet
// sets GOMEMLIMIT below its memory limit).
const defaultGCPercent = 25

func tuneGC(log *slog.Logger) {
	if _, set := os.LookupEnv("GOGC"); set {
		return
	}
	debug.SetGCPercent(defaultGCPercent)
	log.Debug("garbage collector", "gogc", defaultGCPercent, "gomemlimit", os.Getenv("GOMEMLIMIT"))
}
