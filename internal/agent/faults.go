package agent

import (
	"context"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// Faults the tests inject through the x- flags (config.go). None of them is
// set in production; each lives here so the code that serves is free of them.

// slowSyncSource is the --x-slow-sync fault: a name source that contributes
// nothing and reports its first state only after d, so the agent's readiness
// (and a successor's takeover) waits as long as a slow API server makes it.
type slowSyncSource struct {
	d time.Duration
}

func (slowSyncSource) Name() string { return "x-slow-sync" }

func (s slowSyncSource) Run(ctx context.Context, sink names.Sink) error {
	select {
	case <-ctx.Done():
		return nil
	case <-time.After(s.d):
	}
	sink.Synced()
	<-ctx.Done()
	return nil
}

// addFaultSources adds the sources of the faults that are set.
func (c *Config) addFaultSources(store *names.Store) error {
	if c.slowSync <= 0 {
		return nil
	}
	return store.Add(slowSyncSource{d: c.slowSync}, names.SourceOptions{Priority: names.PriorityDemo})
}
