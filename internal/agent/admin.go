package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
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

// checks are what /readyz and /healthz ask.
type checks interface {
	Ready() error
	Live() error
}

// adminServer serves an admin handler on one listener: the admin address
// (TCP) or the agent's local socket in its state directory (unix).
type adminServer struct {
	network   string // "tcp" or "unix"
	addr      string // host:port, or the socket's path
	log       *slog.Logger
	inherited *os.File // a predecessor's listener, served instead of binding
	ln        net.Listener
	hs        *http.Server
	done      chan struct{}
}

// adminMux serves /healthz (liveness), /readyz, /metrics and, when debug is not nil,
// /debug/ (see docs/kubernetes.md for which listener gets which). Every
// answer names the agent that gave it (agentstate.AgentHeader).
func adminMux(reg *prometheus.Registry, c checks, debug http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := c.Live(); err != nil {
			http.Error(w, "not live: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := c.Ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg, Timeout: adminWriteTimeout / 2}))
	if debug != nil {
		mux.Handle("/debug/", debug)
	}
	id := agentID()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(agentstate.AgentHeader, id)
		mux.ServeHTTP(w, r)
	})
}

func newAdminServer(network, addr string, handler http.Handler, inherited *os.File, log *slog.Logger) *adminServer {
	return &adminServer{
		network: network, addr: addr, log: log, inherited: inherited,
		hs: &http.Server{
			Handler:           handler,
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
	ln, err := a.listen(ctx)
	if err != nil {
		return err
	}
	a.ln = ln
	a.done = make(chan struct{})
	go func() {
		defer close(a.done)
		if err := a.hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("admin server", "addr", a.addr, "err", err)
		}
	}()
	return nil
}

// listen returns the inherited listener, or a new one.
func (a *adminServer) listen(ctx context.Context) (net.Listener, error) {
	if a.inherited != nil {
		ln, err := net.FileListener(a.inherited)
		a.inherited.Close()
		a.inherited = nil
		if err != nil {
			return nil, fmt.Errorf("admin listener %s from the previous agent: %w", a.addr, err)
		}
		if ln.Addr().Network() != a.network {
			ln.Close()
			return nil, fmt.Errorf("admin listener %s from the previous agent is %s, not %s", a.addr, ln.Addr().Network(), a.network)
		}
		return ln, nil
	}
	if a.network == "unix" {
		return listenLocal(a.addr)
	}
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(ctx, "tcp", a.addr)
	if err != nil {
		return nil, fmt.Errorf("admin listen %s: %w", a.addr, err)
	}
	return ln, nil
}

// listenLocal binds the local socket at path, replacing a stale one (ours to
// replace: the caller holds the state lock), for its owner (root) only. It
// is not removed when closed: a successor may serve it on.
func listenLocal(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("replace %s: %w", path, err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("restrict %s to its owner: %w", path, err)
	}
	return l, nil
}

// File duplicates the listening socket, for a successor.
func (a *adminServer) File() (*os.File, error) {
	f, ok := a.ln.(interface{ File() (*os.File, error) })
	if a.ln == nil || !ok {
		return nil, errors.New("admin server is not listening")
	}
	return f.File()
}

// Close stops serving (within 2 s for requests in progress) and closes this
// process's descriptor of the listener. Idempotent; safe without Start.
func (a *adminServer) Close() error {
	if a == nil {
		return nil
	}
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

// startAdmin serves the admin endpoints: on the admin address /metrics,
// /healthz and /readyz (and /debug/ when the address is a loopback one: any
// other is reachable from every pod), and all of them on the local socket in
// the state directory, which the CLI uses. In a handover both listeners are
// the predecessor's.
func (a *Agent) startAdmin(ctx context.Context, reg *prometheus.Registry) error {
	log := a.log.With("component", "admin")
	debug := a.cfg.debugHandler(a.store, a.pods, a.work.tapHandler(a.log.With("component", "tap")), a.egress)
	if a.cfg.Admin != "" {
		var dbg http.Handler
		if loopbackAdmin(a.cfg.Admin) {
			dbg = debug
		}
		a.admin = newAdminServer("tcp", a.cfg.Admin, adminMux(reg, a, dbg), a.inherit.TakeAdmin(), log)
		if err := a.admin.Start(ctx); err != nil {
			return err
		}
	}
	if a.plan.mode == ModeOff {
		return nil // no state directory of its own: nowhere to put the socket
	}
	a.local = newAdminServer("unix", agentstate.LocalPath(a.cfg.StateDir), adminMux(reg, a, debug), a.inherit.TakeLocal(), log)
	if err := a.local.Start(ctx); err != nil {
		return err
	}
	a.st.Local = a.local.addr
	return nil
}

// agentID is this process's agentstate.AgentHeader value: its pid and pid
// namespace.
func agentID() string {
	return fmt.Sprintf("pid=%d pidns=%d", os.Getpid(), agentstate.Pidns())
}

// loopbackAdmin reports whether the admin address is reachable from this
// host only: a loopback address or "localhost". Such a listener may serve the
// debug endpoints; any other (the node IP every pod reaches) may not.
func loopbackAdmin(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
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
