package agent

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/names/filesource"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

//go:embed default-names.yaml
var defaultNames []byte

// capture is an installed capture datapath (eBPF or iptables).
type capture interface {
	setReady(bool) error
	run(ctx context.Context)
	close() error
}

// Run runs the agent until ctx is cancelled. Every error it returns before capture is
// installed leaves nothing behind; on return after a stop, capture has been removed
// first and the resolver stopped last.
func Run(ctx context.Context, cfg Config, log *slog.Logger) (err error) {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := checkPrivileges(cfg.Mode); err != nil {
		return err
	}
	tuneGC(log)

	// Undo stack: whatever is set up is torn down in reverse order on any error and on
	// stop.
	var undo []func()
	defer func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}()

	// The Kubernetes source: its API server, and the cluster DNS Service to
	// capture.
	var kubeRest *rest.Config
	if cfg.Kubernetes() {
		if kubeRest, err = cfg.setupKubernetes(ctx, log); err != nil {
			return err
		}
	}

	// Nameservers and upstreams come from resolv.conf, read before capture starts.
	if err := cfg.fillFromResolvConf(log); err != nil {
		return err
	}

	mode, reason, err := cfg.pickMode(log)
	if err != nil {
		return err
	}
	if mode != ModeOff {
		if err := takeOverLeftovers(cfg.StateDir, cfg.BPFFS, log); err != nil {
			return err
		}
	}
	st := &State{
		PID: os.Getpid(), Mode: mode, ModeReason: reason, CaptureAll: cfg.CaptureAll,
		Admin: cfg.Admin, Persist: cfg.Persist, Started: time.Now().UTC(), Netns: currentNetns(),
	}
	for _, n := range cfg.Nameservers {
		st.Nameservers = append(st.Nameservers, n.String())
	}
	for _, u := range cfg.Upstreams {
		st.Upstreams = append(st.Upstreams, u.String())
	}

	// Both capture modes send nameserver i to the listen port + i (docs/design.md):
	// the resolver listens on every slot port of every listen address.
	rcfg := cfg.redirectConfig(log)
	listenAddrs := []string{}
	ports := []uint16{0}
	if mode != ModeOff {
		ports = redirect.SlotPorts(rcfg)
		st.SlotPorts = ports
	}
	for _, l := range cfg.Listen {
		for _, p := range ports {
			if p == 0 {
				p = l.Port()
			}
			listenAddrs = append(listenAddrs, netip.AddrPortFrom(l.Addr(), p).String())
		}
	}
	if mode == ModeEBPF {
		if cfg.Cgroup == "" {
			if cfg.Cgroup, err = redirect.FindCgroup2Mount(); err != nil {
				return fmt.Errorf("find the cgroup2 root: %w", err)
			}
			rcfg.Cgroup = cfg.Cgroup
		}
		mounted, err := ensureBPFFS(cfg.BPFFS)
		if err != nil {
			return err
		}
		if mounted {
			log.Info("mounted bpffs", "path", filepath.Dir(cfg.BPFFS))
		}
		st.Cgroup, st.BPFFS = cfg.Cgroup, cfg.BPFFS
	}
	st.Listen = listenAddrs

	// The state file is written before anything is installed and again after each
	// step, so that `cleanup` after a crash at any point knows what to remove.
	save := func() error { return nil }
	if mode != ModeOff {
		save = func() error { return writeState(cfg.StateDir, st) }
		if err := save(); err != nil {
			return err
		}
		undo = append(undo, func() {
			if err := removeState(cfg.StateDir); err != nil {
				log.Error("remove state", "err", err)
			}
		})
	}

	// Node-local resolver address.
	if mode != ModeOff {
		var addrs []netip.Addr
		for _, l := range cfg.Listen {
			addrs = append(addrs, l.Addr())
		}
		added, err := ensureNodeAddrs(addrs, cfg.LinkName, log)
		if err != nil {
			return err
		}
		st.NodeAddrs = added
		undo = append(undo, func() {
			if err := removeNodeAddrs(added, log); err != nil {
				log.Error("remove node address", "err", err)
			}
		})
		if err := save(); err != nil {
			return err
		}
	}

	// Metrics registry shared by every component.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(newBuildInfo())

	runCtx, stopBackground := context.WithCancel(context.Background())
	undo = append(undo, stopBackground)

	// Name sources and the store that merges them into the name table.
	store, err := cfg.newNameStore(reg, kubeRest, log)
	if err != nil {
		return err
	}
	if err := store.Start(runCtx); err != nil {
		return fmt.Errorf("start name sources: %w", err)
	}
	undo = append(undo, func() { _ = store.Close() })

	// Upstream forwarder.
	ucfg := upstream.NewConfig(cfg.Upstreams...)
	ucfg.Mark = cfg.UpstreamMark
	ucfg.CacheBytes = cfg.CacheBytes
	ucfg.Registerer = reg
	ucfg.Logger = log.With("component", "upstream")
	if mode == ModeOff {
		// Nothing is captured, so nothing needs to recognise our upstream sockets,
		// and the resolver may run unprivileged.
		ucfg.Mark = 0
	}
	fwd, err := upstream.New(ucfg)
	if err != nil {
		return fmt.Errorf("upstream: %w", err)
	}
	if err := fwd.Start(ctx); err != nil {
		_ = fwd.Close()
		return fmt.Errorf("upstream: %w", err)
	}
	undo = append(undo, func() { _ = fwd.Close() })

	// Resolver.
	srv, err := resolver.New(resolver.Config{
		Listen:        listenAddrs,
		Table:         store,
		Forwarder:     fwd,
		PodRecords:    cfg.PodRecords,
		TTL:           cfg.TTL,
		ClusterDomain: cfg.ClusterDomain,
		Authoritative: cfg.Authoritative,
		MaxPending:    cfg.MaxPending,
		MaxTCPConns:   cfg.MaxTCPConns,
		Registerer:    reg,
		Logger:        log.With("component", "resolver"),
	})
	if err != nil {
		return fmt.Errorf("resolver: %w", err)
	}
	if err := srv.Start(runCtx); err != nil {
		return fmt.Errorf("start resolver: %w", err)
	}
	undo = append(undo, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		if err := srv.Shutdown(sctx); err != nil {
			log.Error("stop resolver", "err", err)
		}
	})

	// Capture.
	var capt capture
	switch mode {
	case ModeEBPF:
		dp, err := redirect.Install(rcfg)
		if err != nil {
			return fmt.Errorf("install eBPF datapath: %w", err)
		}
		capt = &ebpfCapture{dp: dp, persist: cfg.Persist}
		reg.MustRegister(newDatapathCollector(cfg.BPFFS))
	case ModeIptables:
		r, err := ctzone.Install(cfg.ctzoneConfig(log))
		if err != nil {
			return fmt.Errorf("install iptables capture: %w", err)
		}
		capt = &iptablesCapture{rules: r}
		st.Backend = r.Backend()
	}
	if err := save(); err != nil {
		if capt != nil {
			_ = capt.close()
		}
		return err
	}
	if capt != nil {
		// Registered after the resolver's undo, so capture is removed before the
		// resolver stops.
		undo = append(undo, func() {
			if err := capt.close(); err != nil {
				log.Error("remove capture", "err", err)
			}
		})
		go capt.run(runCtx)
	}

	// Admin endpoints.
	if cfg.Admin != "" {
		stopAdmin, err := serveAdmin(cfg.Admin, reg, readyFunc(func() error {
			if err := store.Ready(); err != nil {
				return err
			}
			return srv.Ready()
		}), cfg.debugHandler(store), log)
		if err != nil {
			return err
		}
		undo = append(undo, stopAdmin)
	}

	log.Info("meshdns-ebpf running", "mode", mode, "reason", reason, "listen", listenAddrs,
		"nameservers", st.Nameservers, "capture_all", cfg.CaptureAll, "upstreams", st.Upstreams,
		"cgroup", cfg.Cgroup)

	// Readiness follows the resolver: capture is on only while it can answer.
	ready := false
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	for {
		now := srv.Ready() == nil
		if capt != nil && now != ready {
			if err := capt.setReady(now); err != nil {
				return fmt.Errorf("set capture readiness: %w", err)
			}
			log.Info("capture readiness changed", "ready", now)
		}
		ready = now
		select {
		case <-ctx.Done():
			log.Info("stopping: removing capture first, then the resolver")
			return nil
		case <-tick.C:
		}
	}
}

// fillFromResolvConf fills nameservers and upstreams that were not given as flags.
func (c *Config) fillFromResolvConf(log *slog.Logger) error {
	needNS := c.Nameservers == nil && c.Mode != ModeOff
	needUp := len(c.Upstreams) == 0
	if needNS || needUp {
		servers, _, err := upstream.ParseResolvConf(c.ResolvConf)
		if err != nil {
			return fmt.Errorf("read nameservers: %w", err)
		}
		if needNS {
			for _, s := range servers {
				c.Nameservers = append(c.Nameservers, s.Addr())
			}
		}
		if needUp {
			c.Upstreams = servers
		}
	}
	// Never forward to ourselves: our listen addresses on any slot port (the listen
	// port, one per nameserver, one more for capture-all). Another port on the same
	// address is someone else's server and fine.
	ours := func(a netip.Addr, port uint16, checkPort bool) bool {
		for _, l := range c.Listen {
			if a != l.Addr() {
				continue
			}
			if !checkPort || (port >= l.Port() && int(port) <= int(l.Port())+len(c.Nameservers)) {
				return true
			}
		}
		return false
	}
	c.Upstreams = slices.DeleteFunc(c.Upstreams, func(u netip.AddrPort) bool {
		if ours(u.Addr(), u.Port(), true) {
			log.Warn("ignoring upstream that is our own listen address", "upstream", u)
			return true
		}
		return false
	})
	c.Nameservers = slices.DeleteFunc(c.Nameservers, func(n netip.Addr) bool { return ours(n, 0, false) })
	if len(c.Upstreams) == 0 {
		return fmt.Errorf("no upstream nameserver: give --upstream or a nameserver in %s", c.ResolvConf)
	}
	if c.Mode != ModeOff && len(c.Nameservers) == 0 && !c.CaptureAll {
		return fmt.Errorf("nothing to capture: no nameserver in %s and no --nameservers (or use --capture-all)", c.ResolvConf)
	}
	if !c.CaptureLoopback && !c.CaptureAll {
		for _, n := range c.Nameservers {
			if n.IsLoopback() {
				log.Warn("nameserver is a loopback address and is not captured without --capture-loopback", "nameserver", n)
			}
		}
	}
	return nil
}

// pickMode resolves auto into ebpf or iptables and checks a forced mode can work.
func (c *Config) pickMode(log *slog.Logger) (mode, reason string, err error) {
	switch c.Mode {
	case ModeOff:
		return ModeOff, "requested: resolver only, no capture", nil
	case ModeIptables:
		if err := ctzone.Probe(); err != nil {
			return "", "", fmt.Errorf("--mode iptables cannot work here: %w", err)
		}
		return ModeIptables, "requested", nil
	}
	probeErr := c.probeEBPF()
	if c.Mode == ModeEBPF {
		// A forced mode that cannot work fails here, before anything is installed.
		if probeErr != nil {
			return "", "", fmt.Errorf("--mode ebpf cannot work here: %w", probeErr)
		}
		return ModeEBPF, "requested", nil
	}
	if probeErr == nil {
		return ModeEBPF, "auto: the kernel has every eBPF hook the datapath needs", nil
	}
	log.Warn("eBPF capture unavailable, falling back to iptables with conntrack zones", "reason", probeErr)
	if err := ctzone.Probe(); err != nil {
		return "", "", fmt.Errorf("auto mode: eBPF unavailable (%v) and iptables unavailable: %w", probeErr, err)
	}
	return ModeIptables, "auto: eBPF unavailable: " + probeErr.Error(), nil
}

func (c *Config) probeEBPF() error {
	if c.forceNoEBPF != "" {
		return fmt.Errorf("forced probe failure: %s", c.forceNoEBPF)
	}
	f, err := redirect.Probe()
	if err != nil {
		return err
	}
	if missing := f.Missing(); len(missing) > 0 {
		return fmt.Errorf("kernel lacks %v", missing)
	}
	return nil
}

func (c *Config) redirectConfig(log *slog.Logger) redirect.Config {
	rc := redirect.Config{
		Cgroup:          c.Cgroup,
		PinDir:          c.BPFFS,
		Nameservers:     c.Nameservers,
		CaptureAll:      c.CaptureAll,
		CaptureLoopback: c.CaptureLoopback,
		ProxyUIDs:       c.ProxyUIDs,
		UpstreamMark:    c.UpstreamMark,
		Logger:          log.With("component", "redirect"),
	}
	rc.Target4, rc.Target6 = c.targets()
	return rc
}

// targets splits the listen addresses by family (Validate allows one of each).
func (c *Config) targets() (v4, v6 netip.AddrPort) {
	for _, l := range c.Listen {
		if l.Addr().Is4() {
			v4 = l
		} else {
			v6 = l
		}
	}
	return v4, v6
}

func (c *Config) ctzoneConfig(log *slog.Logger) ctzone.Config {
	cc := ctzone.Config{
		Nameservers:  c.Nameservers,
		CaptureAll:   c.CaptureAll,
		ProxyUIDs:    c.ProxyUIDs,
		ProxyGIDs:    c.ProxyGIDs,
		UpstreamMark: c.UpstreamMark,
		Logger:       log.With("component", "ctzone"),
	}
	cc.ListenAddr, cc.ListenAddr6 = c.targets()
	return cc
}

// newNameStore creates the name store with the configured sources: the
// names file, the Kubernetes API server, or the embedded demo table when
// no other source is given.
func (c *Config) newNameStore(reg prometheus.Registerer, kubeRest *rest.Config, log *slog.Logger) (*names.Store, error) {
	m, err := names.NewMetrics(reg)
	if err != nil {
		return nil, err
	}
	store, err := names.New(names.Config{
		Table:   nametable.Options{ClusterDomain: c.ClusterDomain, TTL: c.TTL},
		Logger:  log.With("component", "names"),
		Metrics: m,
	})
	if err != nil {
		return nil, fmt.Errorf("name store: %w", err)
	}
	if c.NamesFile != "" {
		f, err := filesource.NewFile(c.NamesFile, filesource.Options{Domain: store.Domain(), Logger: log.With("component", "names")})
		if err != nil {
			return nil, err
		}
		// The first load must succeed: a bad file at start is bad input, not
		// something to serve around. Later bad files keep the last good
		// table serving.
		if err := f.Check(); err != nil {
			return nil, err
		}
		if err := store.Add(f, names.SourceOptions{Priority: names.PriorityFile}); err != nil {
			return nil, err
		}
	}
	if kubeRest != nil {
		ks, err := kubesource.New(kubesource.Config{
			Name: "kubernetes", Rest: kubeRest, Domain: c.ClusterDomain, NodeName: c.NodeName,
			Logger: log.With("component", "names"),
		})
		if err != nil {
			return nil, err
		}
		if err := store.Add(ks, names.SourceOptions{Priority: names.PriorityKubernetes}); err != nil {
			return nil, err
		}
		c.Mesh.local = ks
	}
	if err := c.addMeshSources(store, kubeRest, log); err != nil {
		return nil, err
	}
	if c.NamesFile == "" && kubeRest == nil && !c.meshSources() {
		demo, err := filesource.NewStatic("demo", defaultNames, store.Domain())
		if err != nil {
			return nil, err
		}
		if err := store.Add(demo, names.SourceOptions{Priority: names.PriorityDemo}); err != nil {
			return nil, err
		}
		log.Info("using the embedded demo name table (give --names FILE for your own)")
	}
	return store, nil
}

// readyFunc adapts a function to the readiness the admin server asks.
type readyFunc func() error

func (f readyFunc) Ready() error { return f() }

type ebpfCapture struct {
	dp      *redirect.Datapath
	persist bool
}

func (e *ebpfCapture) setReady(r bool) error   { return e.dp.SetReady(r) }
func (e *ebpfCapture) run(ctx context.Context) { e.dp.Run(ctx) }
func (e *ebpfCapture) close() error            { return e.dp.Close(e.persist) }

type iptablesCapture struct{ rules *ctzone.Rules }

func (i *iptablesCapture) setReady(bool) error     { return nil }
func (i *iptablesCapture) run(ctx context.Context) { i.rules.Run(ctx) }
func (i *iptablesCapture) close() error            { return i.rules.Close() }

// takeOverLeftovers refuses to start beside a running agent, and removes what a
// crashed one (kill -9) left, so a new start on top of leftovers works.
func takeOverLeftovers(stateDir, pinDir string, log *slog.Logger) error {
	st, err := ReadState(stateDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		log.Warn("unreadable state file; starting anyway", "err", err)
		return nil
	}
	if st.Alive() {
		return fmt.Errorf("another meshdns-ebpf agent (pid %d) is running with state dir %s", st.PID, stateDir)
	}
	removed, err := Cleanup(stateDir, pinDir, log)
	log.Info("removed what a previous agent left", "pid", st.PID, "removed", removed)
	if err != nil {
		return fmt.Errorf("remove leftovers of agent pid %d: %w", st.PID, err)
	}
	return nil
}
