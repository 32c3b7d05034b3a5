package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/version"
)

// readiness is what /readyz asks.
type readiness interface{ Ready() error }

// serveAdmin serves /healthz, /readyz, /metrics and debug (under /debug/) on
// addr and returns its stop func.
func serveAdmin(addr string, reg *prometheus.Registry, r readiness, debug http.Handler, log *slog.Logger) (func(), error) {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := r.Ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	if debug != nil {
		mux.Handle("/debug/", debug)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("admin listen %s: %w", addr, err)
	}
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := hs.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("admin server", "err", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = hs.Shutdown(ctx)
	}, nil
}

func newBuildInfo() prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "meshdns_build_info",
		Help: "Build information: version and Go version.",
	}, []string{"version", "goversion"})
	g.WithLabelValues(version.Version, runtime.Version()).Set(1)
	return g
}

// datapathCollector exports the BPF counters, read from the pinned maps at scrape
// time: the datapath's hot path pays nothing for them.
type datapathCollector struct {
	pinDir string
	desc   *prometheus.Desc
}

func newDatapathCollector(pinDir string) *datapathCollector {
	return &datapathCollector{
		pinDir: pinDir,
		desc: prometheus.NewDesc("meshdns_datapath_events_total",
			"eBPF datapath decisions per hook and counter, summed over CPUs.",
			[]string{"hook", "counter"}, nil),
	}
}

func (c *datapathCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *datapathCollector) Collect(ch chan<- prometheus.Metric) {
	s, err := redirect.ReadStats(c.pinDir)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	for _, h := range s.Hooks {
		// The counters are the numeric fields of HookStats, named by their JSON tags.
		b, err := json.Marshal(h)
		if err != nil {
			ch <- prometheus.NewInvalidMetric(c.desc, err)
			return
		}
		var fields map[string]any
		if err := json.Unmarshal(b, &fields); err != nil {
			ch <- prometheus.NewInvalidMetric(c.desc, err)
			return
		}
		for name, v := range fields {
			if f, ok := v.(float64); ok {
				ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, f, h.Hook, name)
			}
		}
	}
}
