// Package panicguard keeps a panic on the query path from taking the agent down. The
// goroutine that serves a query, encodes a forwarded answer or runs an upstream
// resolution recovers a panic, answers SERVFAIL, and reports it here: it is counted in
// meshdns_panics_total{stage} and logged once with its stack. The process, its other
// queries and capture go on.
package panicguard

import (
	"fmt"
	"log/slog"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// Stages of meshdns_panics_total: where on the query path a panic was recovered.
const (
	StageServe       = "serve"       // reading, deciding and answering a received query
	StageAnswer      = "answer"      // encoding and sending a forwarded answer
	StageUpstream    = "upstream"    // an upstream resolution (shared by identical misses)
	StageAttribution = "attribution" // naming the sender of a query (the datapath's flow records)
)

var stages = []string{StageServe, StageAnswer, StageUpstream, StageAttribution}

// Counter counts and logs recovered panics. A nil *Counter logs them to slog's default
// logger and counts nothing. Its methods are safe for concurrent use.
type Counter struct {
	log      *slog.Logger
	vec      *prometheus.CounterVec
	byStage  map[string]prometheus.Counter
	register prometheus.Registerer
}

// New returns a Counter whose meshdns_panics_total is registered with reg (nil: not
// registered) and which logs to log (nil: slog's default).
func New(reg prometheus.Registerer, log *slog.Logger) (*Counter, error) {
	if log == nil {
		log = slog.Default()
	}
	c := &Counter{
		log: log,
		vec: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshdns_panics_total",
			Help: "Panics recovered on the query path, by stage; each query concerned was answered SERVFAIL.",
		}, []string{"stage"}),
		byStage:  make(map[string]prometheus.Counter, len(stages)),
		register: reg,
	}
	for _, s := range stages {
		c.byStage[s] = c.vec.WithLabelValues(s) // every series from the start, at 0
	}
	if reg != nil {
		if err := reg.Register(c.vec); err != nil {
			return nil, fmt.Errorf("register meshdns_panics_total: %w", err)
		}
	}
	return c, nil
}

// Recovered reports v, a value recover() returned at stage, with attrs saying which
// query it was. Call it from the deferred function that recovered.
func (c *Counter) Recovered(stage string, v any, attrs ...any) {
	log := slog.Default()
	if c != nil {
		log = c.log
		if ctr, ok := c.byStage[stage]; ok {
			ctr.Inc()
		}
	}
	attrs = append([]any{"stage", stage, "panic", fmt.Sprint(v), "stack", string(debug.Stack())}, attrs...)
	log.Error("recovered a panic on the query path; the query is answered SERVFAIL", attrs...)
}

// Describe and Collect make a Counter a prometheus.Collector of meshdns_panics_total,
// for a registry it was not created with.
func (c *Counter) Describe(ch chan<- *prometheus.Desc) { c.vec.Describe(ch) }

// Collect implements prometheus.Collector.
func (c *Counter) Collect(ch chan<- prometheus.Metric) { c.vec.Collect(ch) }

// Unregister removes the metric from the registerer New was given.
func (c *Counter) Unregister() {
	if c != nil && c.register != nil {
		c.register.Unregister(c.vec)
	}
}
