package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/version"
)

// Admin server timeouts: a slow or stuck client holds a connection for at most
// this long, so floods of them cannot starve /healthz and /metrics.
const (
	adminReadHeaderTimeout = 5 * time.Second
	adminReadTimeout       = 10 * time.Second
	adminWriteTimeout      = 10 * time.Second
	adminIdleTimeout       = 30 * time.Second
	adminMaxHeaderBytes    = 16 << 10
)

// readiness is what /readyz asks.
type readiness interface{ Ready() error }

// adminServer serves /healthz, /readyz, /metrics and debug (under /debug/).
type adminServer struct {
	addr      string
	ready     readiness
	log       *slog.Logger
	inherited *os.File // a predecessor's listener, served instead of binding
	ln        *net.TCPListener
	hs        *http.Server
	done      chan struct{}
}

func newAdminServer(addr string, reg *prometheus.Registry, ready readiness, debug http.Handler, inherited *os.File, log *slog.Logger) *adminServer {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := ready.Ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg, Timeout: adminWriteTimeout / 2}))
	if debug != nil {
		mux.Handle("/debug/", debug)
	}
	return &adminServer{
		addr: addr, ready: ready, log: log, inherited: inherited,
		hs: &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: adminReadHeaderTimeout,
			ReadTimeout:       adminReadTimeout,
			WriteTimeout:      adminWriteTimeout,
			IdleTimeout:       adminIdleTimeout,
			MaxHeaderBytes:    adminMaxHeaderBytes,
		},
	}
}

// Start listens (or takes over the inherited listener) and serves.
func (a *adminServer) Start(ctx context.Context) error {
	var ln net.Listener
	var err error
	if a.inherited != nil {
		ln, err = net.FileListener(a.inherited)
		a.inherited.Close()
		a.inherited = nil
		if err != nil {
			return fmt.Errorf("admin listener from the previous agent: %w", err)
		}
	} else {
		var lc net.ListenConfig
		lc.SetMultipathTCP(false)
		if ln, err = lc.Listen(ctx, "tcp", a.addr); err != nil {
			return fmt.Errorf("admin listen %s: %w", a.addr, err)
		}
	}
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		ln.Close()
		return fmt.Errorf("admin listener is a %T, not TCP", ln)
	}
	a.ln = tl
	a.done = make(chan struct{})
	go func() {
		defer close(a.done)
		if err := a.hs.Serve(tl); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("admin server", "err", err)
		}
	}()
	return nil
}

// File duplicates the listening socket, for a successor.
func (a *adminServer) File() (*os.File, error) {
	if a.ln == nil {
		return nil, errors.New("admin server is not listening")
	}
	return a.ln.File()
}

// Close stops serving (within 2 s for requests in progress) and closes this
// process's descriptor of the listener. Idempotent; safe without Start.
func (a *adminServer) Close() error {
	if a.inherited != nil {
		a.inherited.Close()
		a.inherited = nil
	}
	if a.done == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err := a.hs.Shutdown(ctx)
	<-a.done
	a.done = nil
	return err
}

func newBuildInfo() prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "meshdns_build_info",
		Help: "Build information: version and Go version.",
	}, []string{"version", "goversion"})
	g.WithLabelValues(version.Version, runtime.Version()).Set(1)
	return g
}

// datapathCollector exports the BPF counters, read from the live maps of the
// running datapath at scrape time (one lookup per hook; no pins are opened and
// no cgroup is named): the datapath's hot path pays nothing for them.
type datapathCollector struct {
	read func() ([]redirect.HookStats, error)
	desc *prometheus.Desc
}

func newDatapathCollector(read func() ([]redirect.HookStats, error)) *datapathCollector {
	return &datapathCollector{
		read: read,
		desc: prometheus.NewDesc("meshdns_datapath_events_total",
			"eBPF datapath decisions per hook and counter, summed over CPUs.",
			[]string{"hook", "counter"}, nil),
	}
}

func (c *datapathCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *datapathCollector) Collect(ch chan<- prometheus.Metric) {
	hooks, err := c.read()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	names := redirect.CounterNames()
	for _, h := range hooks {
		for i, v := range h.Counters {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(v), h.Hook, names[i])
		}
	}
}
