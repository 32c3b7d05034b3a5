package agent

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/talkers"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// WorkloadConfig is who-asked: naming the workload behind every query, the
// top talkers, and the tap (docs/observability.md). The flag names are a
// contract.
type WorkloadConfig struct {
	Attribution    bool          // --attribution
	TopK           int           // --top-k
	TopWindow      time.Duration // --top-window
	Namespaces     bool          // --namespace-metrics
	NamespaceLimit int           // --namespace-metrics-limit
}

func (c *Config) registerWorkloadFlags(fs *flag.FlagSet) {
	w := &c.Workloads
	fs.BoolVar(&w.Attribution, "attribution", true, "name the workload behind every query (eBPF mode: the sender's cgroup, recorded by the datapath; any mode: the pod that has the source address) and export the top talkers")
	fs.IntVar(&w.TopK, "top-k", talkers.DefaultK, "workloads in each top-talkers ranking (queries, NXDOMAIN, unanswered), plus one \"(other)\" series")
	fs.DurationVar(&w.TopWindow, "top-window", talkers.DefaultWindow, "sliding window of the top-talkers rankings, a multiple of 5s")
	fs.BoolVar(&w.Namespaces, "namespace-metrics", false, "also count queries and NXDOMAIN answers per namespace of the sender (meshdns_namespace_*_total)")
	fs.IntVar(&w.NamespaceLimit, "namespace-metrics-limit", talkers.DefaultNamespaceLimit, "at most this many namespaces get their own series; the rest count as \"(other)\"")
}

func (c *Config) validateWorkloads() error {
	w := c.Workloads
	if _, err := talkers.New(c.trackerConfig(nil)); err != nil {
		return fmt.Errorf("--top-k %d, --top-window %s, --namespace-metrics-limit %d: %w", w.TopK, w.TopWindow, w.NamespaceLimit, err)
	}
	return nil
}

func (c *Config) trackerConfig(n *workload.Namer) talkers.Config {
	w := c.Workloads
	tc := talkers.Config{K: w.TopK, Window: w.TopWindow, Namespaces: w.Namespaces, NamespaceLimit: w.NamespaceLimit,
		Name: func(workload.Key) workload.Identity { return workload.Identity{} }}
	if n != nil {
		tc.Name, tc.Learn = n.Name, n.Learn
	}
	return tc
}

// workloads is the agent's who-asked part: the namer, the top talkers (with
// attribution on) and the tap hub.
type workloads struct {
	namer   *workload.Namer
	tracker *talkers.Tracker // nil with --attribution=false
	hub     *tap.Hub
}

// newWorkloads makes the who-asked part; pods is this node's pod index (nil:
// no Kubernetes source). Its metrics go to reg.
func (c *Config) newWorkloads(pods workload.PodIndex, reg prometheus.Registerer) (*workloads, error) {
	w := &workloads{hub: tap.NewHub(0, 0), namer: workload.NewNamer(pods)}
	if c.Workloads.Attribution {
		t, err := talkers.New(c.trackerConfig(w.namer))
		if err != nil {
			return nil, err
		}
		w.tracker = t
		reg.MustRegister(t)
	}
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "meshdns_tap_subscribers", Help: "Tap subscribers (meshdns-ebpf tap) connected now."},
			func() float64 { return float64(w.hub.Subscribers()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "meshdns_tap_lost_total", Help: "Tap records lost because a subscriber read too slowly (each was told)."},
			func() float64 { return float64(w.hub.Lost()) }),
	)
	return w, nil
}

// Start starts the namer and the window of the top talkers.
func (w *workloads) Start(ctx context.Context) error {
	if err := w.namer.Start(ctx); err != nil {
		return fmt.Errorf("workload names: %w", err)
	}
	if w.tracker != nil {
		return w.tracker.Start(ctx)
	}
	return nil
}

// Close stops them. Idempotent; safe on nil and without Start.
func (w *workloads) Close() error {
	if w == nil {
		return nil
	}
	if w.tracker != nil {
		_ = w.tracker.Close()
	}
	return w.namer.Close()
}

// configure gives the resolver the sender lookup (the datapath's flow
// records, when there are any and attribution or egress is on: the cgroup and
// process only with attribution), the counter and the tap.
func (w *workloads) configure(rc *resolver.Config, flows *redirect.Flows, egress bool) {
	rc.Tap = w.hub
	attribution := w.tracker != nil
	if attribution {
		rc.Talkers = w.tracker.Counter()
	}
	if flows == nil || !attribution && !egress {
		return
	}
	rc.Senders = func(src netip.AddrPort, tcp bool) (resolver.Sender, bool) {
		s, ok := flows.Lookup(src, tcp)
		if !attribution {
			return resolver.Sender{Egress: s.Workload}, ok
		}
		return resolver.Sender{Cgroup: s.Cgroup, PID: s.PID, Egress: s.Workload}, ok
	}
}

// tapHandler serves /debug/tap.
func (w *workloads) tapHandler(log *slog.Logger) http.Handler {
	return w.hub.Handler(w.namer.Name, log)
}
