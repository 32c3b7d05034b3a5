package upstream

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Failure reasons of meshdns_upstream_failures_total.
const (
	reasonTimeout   = "timeout"   // no (valid) answer within the attempt deadline, and none to anything else meanwhile
	reasonDropped   = "dropped"   // no answer to this query from an upstream that answered others meanwhile (rate limiting, loss)
	reasonRefused   = "refused"   // connection refused (ICMP port unreachable, TCP RST)
	reasonNetwork   = "network"   // any other socket error
	reasonServfail  = "servfail"  // the upstream answered SERVFAIL
	reasonRcode     = "rejected"  // the upstream answered REFUSED, NOTIMP or FORMERR
	reasonTruncated = "truncated" // truncated over UDP and the TCP retry failed too
	reasonMismatch  = "mismatch"  // a reply that did not match the query was dropped
	reasonOverload  = "overload"  // the in-flight cap was reached (label upstream="")
)

var failureReasons = []string{reasonTimeout, reasonDropped, reasonRefused, reasonNetwork, reasonServfail, reasonRcode, reasonTruncated, reasonMismatch}

// metrics holds the collectors and the pre-resolved children used on the query path.
type metrics struct {
	collectors []prometheus.Collector

	hitSuccess, hitDenial, hitStale prometheus.Counter
	misses, prefetch                prometheus.Counter
	overload                        prometheus.Counter
	retryOverBudget                 prometheus.Counter
}

// serverMetrics are one upstream's pre-created children.
type serverMetrics struct {
	reqUDP, reqTCP prometheus.Counter
	failures       map[string]prometheus.Counter
	healthy        prometheus.Gauge
	transitions    prometheus.Counter
	duration       prometheus.Observer
}

func newMetrics(reg prometheus.Registerer, c *cache, servers []*server) (*metrics, error) {
	cm := newCacheMetrics(c)
	um := newUpstreamVecs()
	retryOverBudget := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshdns_upstream_retries_over_budget_total",
		Help: "Upstream retries not sent because the workload charged for the miss had no token left in its budget (--workload-qps): the query was answered as on a last timeout.",
	})
	m := &metrics{
		collectors:      append(cm.collectors, um.requests, um.failures, um.transitions, um.healthy, um.duration, retryOverBudget),
		retryOverBudget: retryOverBudget,
		hitSuccess:      cm.hits.WithLabelValues("success"),
		hitDenial:       cm.hits.WithLabelValues("denial"),
		hitStale:        cm.hits.WithLabelValues("stale"),
		misses:          cm.misses,
		prefetch:        cm.prefetch,
		overload:        um.failures.WithLabelValues("", reasonOverload),
	}
	for _, s := range servers {
		s.m = um.forServer(s.name)
	}
	if err := registerAll(reg, m.collectors); err != nil {
		return nil, err
	}
	return m, nil
}

// cacheMetrics are the upstream cache's metrics.
type cacheMetrics struct {
	hits       *prometheus.CounterVec
	misses     prometheus.Counter
	prefetch   prometheus.Counter
	collectors []prometheus.Collector
}

// newCacheMetrics makes the cache's metrics (c nil: no cache, zeros).
func newCacheMetrics(c *cache) cacheMetrics {
	hits := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_cache_hits_total",
		Help: "Answers served from the upstream cache, by type (success, denial, stale).",
	}, []string{"type"})
	misses := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshdns_cache_misses_total",
		Help: "Forwarded queries that found no fresh cache entry.",
	})
	entries := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshdns_cache_entries",
		Help: "Entries in the upstream cache.",
	}, func() float64 {
		if c == nil {
			return 0
		}
		return float64(c.len())
	})
	evictions := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "meshdns_cache_evictions_total",
		Help: "Cache entries evicted because the cache was full (in entries or bytes).",
	}, func() float64 {
		if c == nil {
			return 0
		}
		return float64(c.evicted.Load())
	})
	cacheBytes := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshdns_cache_bytes",
		Help: "Estimated memory held by the upstream cache (capped by --cache-bytes).",
	}, func() float64 {
		if c == nil {
			return 0
		}
		return float64(c.bytes.Load())
	})
	// The cap the cache evicts at: its shards' byte budgets summed.
	cacheMax := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshdns_cache_max_bytes",
		Help: "Memory cap of the upstream cache (--cache-bytes): meshdns_cache_bytes stays below it by evicting.",
	}, func() float64 {
		if c == nil {
			return 0
		}
		return float64(c.shardBytes * len(c.shards))
	})
	workloadEvictions := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "meshdns_cache_workload_evictions_total",
		Help: "Cache entries evicted because the workload whose miss cached them was over its share (--cache-workload-bytes): its own oldest.",
	}, func() float64 {
		if c == nil {
			return 0
		}
		return float64(c.shares.evictions())
	})
	workloadMax := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshdns_cache_workload_max_bytes",
		Help: "The share of the upstream cache one workload's misses may hold (--cache-workload-bytes; 0: no cap).",
	}, func() float64 {
		if c == nil {
			return 0
		}
		return float64(c.shares.cap)
	})
	prefetch := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshdns_cache_prefetch_total",
		Help: "Popular cache entries refreshed before they expired.",
	})
	return cacheMetrics{hits: hits, misses: misses, prefetch: prefetch,
		collectors: []prometheus.Collector{hits, misses, entries, cacheBytes, cacheMax, evictions, workloadEvictions, workloadMax, prefetch}}
}

// upstreamVecs are the per-upstream metrics, labelled by upstream.
type upstreamVecs struct {
	requests, failures, transitions *prometheus.CounterVec
	healthy                         *prometheus.GaugeVec
	duration                        *prometheus.HistogramVec
}

func newUpstreamVecs() upstreamVecs {
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_upstream_requests_total",
		Help: "Queries sent to an upstream, by upstream and transport.",
	}, []string{"upstream", "proto"})
	failures := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_upstream_failures_total",
		Help: "Failed upstream attempts, by upstream and reason.",
	}, []string{"upstream", "reason"})
	transitions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_upstream_health_transitions_total",
		Help: "Changes of an upstream's health (into and out of rotation), by upstream.",
	}, []string{"upstream"})
	healthy := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "meshdns_upstream_healthy",
		Help: "1 while the upstream is considered healthy, 0 while it is skipped and probed.",
	}, []string{"upstream"})
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "meshdns_upstream_request_duration_seconds",
		Help:    "Duration of upstream exchanges that got an answer.",
		Buckets: prometheus.ExponentialBuckets(0.00025, 2, 14), // 250us .. ~2s
	}, []string{"upstream"})

	return upstreamVecs{requests: requests, failures: failures, transitions: transitions, healthy: healthy, duration: duration}
}

// forServer is one upstream's metrics; it starts healthy.
func (v upstreamVecs) forServer(name string) *serverMetrics {
	sm := &serverMetrics{
		reqUDP:      v.requests.WithLabelValues(name, "udp"),
		reqTCP:      v.requests.WithLabelValues(name, "tcp"),
		failures:    make(map[string]prometheus.Counter, len(failureReasons)),
		healthy:     v.healthy.WithLabelValues(name),
		transitions: v.transitions.WithLabelValues(name),
		duration:    v.duration.WithLabelValues(name),
	}
	for _, r := range failureReasons {
		sm.failures[r] = v.failures.WithLabelValues(name, r)
	}
	sm.healthy.Set(1)
	return sm
}

// registerAll registers every collector with reg (nil: none), or none of
// them.
func registerAll(reg prometheus.Registerer, collectors []prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	for i, col := range collectors {
		if err := reg.Register(col); err != nil {
			for _, done := range collectors[:i] {
				reg.Unregister(done)
			}
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return fmt.Errorf("register upstream metrics: already registered (one Forwarder per registry): %w", err)
			}
			return fmt.Errorf("register upstream metrics: %w", err)
		}
	}
	return nil
}
