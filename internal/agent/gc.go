package agent

import (
	"log/slog"
	"os"
	"runtime/debug"
)

// defaultGCPercent is the agent's GOGC when the environment sets none.
// The agent's heap is mostly its name table, which lives as long as the
// process, and its query path does not allocate: collecting at 1.5x the
// live heap instead of 2x keeps a 100k-Service node's memory well under
// the DaemonSet's limit at little CPU cost. GOGC and GOMEMLIMIT in the
// environment take precedence (the DaemonSet sets GOMEMLIMIT below its
// memory limit).
const defaultGCPercent = 50

func tuneGC(log *slog.Logger) {
	if _, set := os.LookupEnv("GOGC"); set {
		return
	}
	debug.SetGCPercent(defaultGCPercent)
	log.Debug("garbage collector", "gogc", defaultGCPercent, "gomemlimit", os.Getenv("GOMEMLIMIT"))
}
