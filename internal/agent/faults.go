package agent

import (
	"context"
	"strings"
	"sync/atomic"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
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

// wedgeForwarder is the --x-wedge-on fault: the first query for name that
// reaches the cache wedges the query path. That query and every later one
// that reaches the cache (every forwarded name) block their reader for good,
// as a deadlock in the cache would: the resolver stops reading its sockets.
type wedgeForwarder struct {
	resolver.Forwarder
	name   string
	wedged atomic.Bool
	never  chan struct{}
}

func (w *wedgeForwarder) Cached(q *upstream.Query) (upstream.Answer, bool) {
	if w.wedged.Load() || strings.EqualFold(strings.TrimSuffix(q.Name, "."), w.name) {
		w.wedged.Store(true)
		<-w.never
	}
	return w.Forwarder.Cached(q)
}

// forwarder is fwd, wedged by the --x-wedge-on fault when it is set.
func (c *Config) forwarder(fwd resolver.Forwarder) resolver.Forwarder {
	if c.wedgeOn == "" {
		return fwd
	}
	return &wedgeForwarder{Forwarder: fwd, name: strings.TrimSuffix(c.wedgeOn, "."), never: make(chan struct{})}
}
