package agent

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/kubelife"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

//go:embed default-names.yaml
var defaultNames []byte

// Drain bounds (docs/design.md, "Upgrades, restarts and crashes"): a stopping
// agent with no successor keeps reading until its sockets were quiet for
// drainQuiet after capture went off (queries redirected just before still
// arrive), then answers what it read, in-flight forwards included, within
// drainTimeout.
const (
	drainQuiet   = 100 * time.Millisecond
	drainTimeout = 5 * time.Second
	// readinessInterval is how often capture follows the resolver's readiness.
	readinessInterval = 100 * time.Millisecond
)

// Agent is meshdns-ebpf on a node. New validates, Start acquires and starts
// everything (taking over from a running agent when there is one), Close stops
// it: capture off, then the resolver drains, then everything is released, or,
// when a successor took over, only this process's descriptors are released.
type Agent struct {
	cfg Config
	log *slog.Logger

	// Set by Start, released by shutdown.
	mode, reason string
	lock         *stateLock
	inherit      *inheritance
	st           *State
	nodes        *nodeAddrs
	store        *names.Store
	work         *workloads
	fwd          *upstream.Forwarder
	srv          *resolver.Server
	dp           *redirect.Datapath
	rules        *ctzone.Rules
	live         *liveness    // the resolver's liveness (/healthz)
	liveClose    func() error // closes the liveness probe's socket
	admin        *adminServer // the admin address
	local        *adminServer // the local socket in the state dir
	hl           *net.UnixListener
	life         *kubelife.Watch // the agent's own pod, DaemonSet and namespace (Kubernetes)
	stopLoops    chan struct{}
	loops        sync.WaitGroup

	mu          sync.Mutex
	started     bool
	closing     bool
	serving     bool          // resolver sockets registered with the datapath
	handingOver chan struct{} // non-nil while a handover runs; closed when it ends
	takingOver  int           // the predecessor's pid while this agent takes over from it
	hconn       *net.UnixConn // the handover connection in progress
	handedOff   bool
	successor   int
	uninstall   bool // the stop removes everything (followLifecycle)

	shutOnce sync.Once
	shutDone chan struct{}
	shutErr  error
}

// New validates cfg. It touches nothing.
func New(cfg Config, log *slog.Logger) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Agent{cfg: cfg, log: log, stopLoops: make(chan struct{}), shutDone: make(chan struct{})}, nil
}

// Start starts the agent; ctx bounds the start (a handover waits at most
// handoverTimeout). Every error it returns leaves nothing behind that was not
// there before, and a predecessor it was taking over from serves on.
func (a *Agent) Start(ctx context.Context) (err error) {
	a.mu.Lock()
	if a.started {
		a.mu.Unlock()
		return errors.New("agent already started")
	}
	a.started = true
	a.mu.Unlock()
	cfg, log := &a.cfg, a.log
	defer func() {
		if err != nil {
			a.abort()
		}
	}()

	tuneGC(cfg, log)

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
	rcfg := cfg.redirectConfig(log)
	ports := []uint16{0}
	if cfg.Mode != ModeOff {
		ports = redirect.SlotPorts(rcfg)
	}
	if err := checkPrivileges(cfg.Mode, cfg.IptablesBackend, ports); err != nil {
		return err
	}
	if a.mode, a.reason, err = cfg.pickMode(log); err != nil {
		return err
	}
	if a.mode != cfg.Mode {
		if err := checkPrivileges(a.mode, cfg.IptablesBackend, ports); err != nil {
			return err
		}
	}
	mode := a.mode
	var listenAddrs []string
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
			if cfg.Cgroup, err = cgroup2.FindMount(); err != nil {
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
	}

	// The state lock, or the running agent's descriptors (its lock among them).
	var prev *State
	if mode != ModeOff {
		if err := a.acquire(ctx); err != nil {
			return err
		}
		if a.inherit != nil {
			prev = a.inherit.state
		} else if prev, err = ReadState(cfg.StateDir); err == nil {
			// A clean stop removes the state file: its owner crashed.
			a.takeOverLeftovers(prev)
		} else if !errors.Is(err, os.ErrNotExist) {
			log.Warn("unreadable state file of a previous agent; ignoring it", "err", err)
			prev = nil
		}
		if a.inherit == nil && mode != ModeEBPF {
			// An eBPF agent stopped here earlier left its programs attached
			// (inert) for a successor in eBPF mode: this one is not.
			if removed, err := redirect.Cleanup(cfg.BPFFS); len(removed) > 0 || err != nil {
				log.Info("removed the eBPF programs an earlier agent left", "pin_dir", cfg.BPFFS, "removed", len(removed), "err", err)
			}
		}
	}
	st := &State{
		PID: os.Getpid(), Mode: mode, ModeReason: a.reason, CaptureAll: cfg.CaptureAll,
		Admin: cfg.Admin, Persist: cfg.Persist, Started: time.Now().UTC(), Netns: currentNetns(),
		Listen: listenAddrs,
	}
	if mode != ModeOff {
		st.SlotPorts = ports
	}
	if a.inherit != nil {
		st.Predecessor = a.inherit.from
	}
	if mode == ModeEBPF {
		st.Cgroup, st.BPFFS = cfg.Cgroup, cfg.BPFFS
	}
	for _, n := range cfg.Nameservers {
		st.Nameservers = append(st.Nameservers, n.String())
	}
	for _, u := range cfg.Upstreams {
		st.Upstreams = append(st.Upstreams, u.String())
	}
	a.st = st
	if mode == ModeEBPF {
		a.reportBPFFS()
	}

	// The state file is written before anything is installed and again after each
	// step, so that `cleanup` after a crash at any point knows what to remove. In a
	// handover the predecessor's file stays until we serve.
	if mode != ModeOff && a.inherit == nil {
		if err := a.save(); err != nil {
			return err
		}
	}

	// Node-local resolver address.
	if mode != ModeOff {
		var want []netip.Addr
		for _, l := range cfg.Listen {
			want = append(want, l.Addr())
		}
		var adopt []NodeAddr
		if prev != nil && prev.Netns == currentNetns() {
			adopt = prev.NodeAddrs
		}
		a.nodes = newNodeAddrs(want, cfg.LinkName, adopt, log)
		if err := a.nodes.Start(ctx); err != nil {
			return err
		}
		st.NodeAddrs = a.nodes.added
		if a.inherit == nil {
			if err := a.save(); err != nil {
				return err
			}
		}
	}

	// Metrics registry shared by every component.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(newBuildInfo())
	reg.MustRegister(a.newStateMetrics(mode)...)

	// Name sources and the store that merges them into the name table.
	if a.store, err = cfg.newNameStore(reg, kubeRest, log); err != nil {
		return err
	}
	if err := a.store.Start(ctx); err != nil {
		return fmt.Errorf("start name sources: %w", err)
	}
	if kubeRest != nil && mode != ModeOff {
		a.watchLifecycle(ctx, kubeRest)
	}
	if a.inherit != nil {
		// Our resolver will read the predecessor's sockets as soon as it starts:
		// not before it can answer as well as the predecessor does.
		if err := waitReady(ctx, a.store.Ready, handoverTimeout); err != nil {
			return fmt.Errorf("taking over: the name sources are not ready: %w", err)
		}
	}

	// Who asked: workload names, top talkers, the tap.
	var pods workload.PodIndex
	if cfg.Mesh.local != nil {
		pods = cfg.Mesh.local
	}
	if a.work, err = cfg.newWorkloads(pods, reg); err != nil {
		return err
	}
	if err := a.work.Start(ctx); err != nil {
		return err
	}

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
	if a.fwd, err = upstream.New(ucfg); err != nil {
		return fmt.Errorf("upstream: %w", err)
	}
	if err := a.fwd.Start(ctx); err != nil {
		return fmt.Errorf("upstream: %w", err)
	}

	// The eBPF datapath first: it adopts the pinned links (a predecessor's
	// programs are replaced in place) before the resolver counts its progress.
	if mode == ModeEBPF {
		rcfg.Detach = !cfg.Persist
		if a.dp, err = redirect.New(rcfg); err != nil {
			return fmt.Errorf("eBPF datapath: %w", err)
		}
		if err := a.dp.Start(ctx); err != nil {
			return fmt.Errorf("install eBPF datapath: %w", err)
		}
		reg.MustRegister(newDatapathCollector(a.dp.HookStats), newForeignProgramsCollector(a.dp.CgroupPrograms))
	}

	// Resolver, on the predecessor's sockets when there is one.
	rc := resolver.Config{
		Listen:        listenAddrs,
		Table:         a.store,
		Forwarder:     cfg.forwarder(a.fwd),
		PodRecords:    cfg.PodRecords,
		TTL:           cfg.TTL,
		ClusterDomain: cfg.ClusterDomain,
		Authoritative: cfg.Authoritative,
		MaxPending:    cfg.MaxPending,
		MaxTCPConns:   cfg.MaxTCPConns,
		Registerer:    reg,
		Logger:        log.With("component", "resolver"),
	}
	var flows *redirect.Flows
	if a.dp != nil {
		rc.OnDequeue = a.dp.Dequeued
		flows = a.dp.Flows()
	}
	a.work.configure(&rc, flows)
	if a.inherit != nil {
		rc.Inherited, a.inherit.listeners = a.inherit.listeners, nil
	}
	if a.srv, err = resolver.New(rc); err != nil {
		return fmt.Errorf("resolver: %w", err)
	}
	if err := a.srv.Start(ctx); err != nil {
		return fmt.Errorf("start resolver: %w", err)
	}
	tuneProcs(a.srv.BlockingReaders(), log)
	if err := a.watchLiveness(); err != nil {
		return err
	}

	if mode == ModeIptables {
		if a.rules, err = ctzone.New(cfg.ctzoneConfig(log)); err != nil {
			return fmt.Errorf("iptables capture: %w", err)
		}
		if err := a.rules.Start(ctx); err != nil {
			return fmt.Errorf("install iptables capture: %w", err)
		}
		st.Backend = a.rules.Backend()
	}

	// Admin endpoints: the admin address and the local socket.
	if err := a.startAdmin(ctx, reg); err != nil {
		return err
	}

	// Capture on, as soon as the resolver is ready (at once, normally: the name
	// table's first load is done).
	if err := a.followReadiness(); err != nil {
		return err
	}
	// Taking over, nothing of the node's state is touched before the
	// predecessor knows we serve: if we die before, it serves on as it was.
	if a.inherit != nil {
		a.inherit.closeUnused()
		if cfg.handoverFault == "successor" {
			log.Error("x-handover-fault: the successor dies before it serves")
			os.Exit(3)
		}
		if err := a.inherit.serving(); err != nil {
			log.Warn("could not tell the previous agent that we serve; it may have died", "pid", a.inherit.from, "err", err)
		}
		if prev != nil {
			a.removeUnwantedAddrs(prev)
		}
		log.Info("took over from the previous agent", "pid", a.inherit.from)
		a.inherit = nil
		a.setTakingOver(0)
		if mode != ModeOff {
			if a.hl, err = listenHandover(cfg.StateDir); err != nil {
				log.Error("no handover socket: a successor will not be able to take over", "err", err)
			}
			if err := a.save(); err != nil {
				log.Error("write state", "err", err)
			}
		}
	} else if mode != ModeOff {
		if a.hl, err = listenHandover(cfg.StateDir); err != nil {
			return err
		}
		if err := a.save(); err != nil {
			return err
		}
	}
	a.loops.Add(2)
	go a.readinessLoop()
	go a.livenessLoop()
	if a.hl != nil {
		a.loops.Add(1)
		go a.handoverLoop()
	}
	log.Info("meshdns-ebpf running", "mode", mode, "reason", a.reason, "listen", listenAddrs,
		"nameservers", st.Nameservers, "capture_all", cfg.CaptureAll, "upstreams", st.Upstreams,
		"cgroup", cfg.Cgroup)
	return nil
}

// Ready is the agent's readiness (/readyz): the name sources' and the
// resolver's, once it serves the node: not while it is still taking over,
// nor once it handed over.
func (a *Agent) Ready() error {
	a.mu.Lock()
	off, succ, pred := a.handedOff, a.successor, a.takingOver
	a.mu.Unlock()
	if off {
		return fmt.Errorf("handed over to pid %d", succ)
	}
	if pred != 0 {
		return fmt.Errorf("taking over from pid %d", pred)
	}
	if a.srv == nil || a.store == nil {
		return errors.New("resolver not started")
	}
	if err := a.store.Ready(); err != nil {
		return err
	}
	return a.srv.Ready()
}

// Live is the agent's liveness (/healthz): its resolver is not wedged. An
// agent that handed over (it waits for its SIGTERM) or is stopping is live.
func (a *Agent) Live() error {
	a.mu.Lock()
	done := a.handedOff || a.closing
	a.mu.Unlock()
	if done || a.live == nil {
		return nil
	}
	return a.live.check(time.Now())
}

// watchLiveness sets up the resolver's liveness monitor (liveness.go), which
// probes the resolver's first address.
func (a *Agent) watchLiveness() error {
	addrs := a.srv.Addrs()
	if len(addrs) == 0 {
		return errors.New("liveness: the resolver has no address")
	}
	send, closeProbe, err := resolverProbe(addrs[0])
	if err != nil {
		return err
	}
	a.liveClose = closeProbe
	a.live = newLiveness(a.srv.Progress, send, time.Now())
	return nil
}

func (a *Agent) livenessLoop() {
	defer a.loops.Done()
	t := time.NewTicker(livenessInterval)
	defer t.Stop()
	for {
		select {
		case <-a.stopLoops:
			return
		case now := <-t.C:
			a.live.look(now)
		}
	}
}

// setTakingOver records the predecessor this agent takes over from (0: none).
func (a *Agent) setTakingOver(pid int) {
	a.mu.Lock()
	a.takingOver = pid
	a.mu.Unlock()
}

// waitReady polls ready until it reports nil, ctx is done or d passed.
func waitReady(ctx context.Context, ready func() error, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		err := ready()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (a *Agent) save() error {
	if a.st == nil {
		return nil
	}
	return writeState(a.cfg.StateDir, a.st)
}

// acquire takes the state lock, or, while another agent holds it, takes over
// from that agent: its lock, admin listener and resolver sockets.
func (a *Agent) acquire(ctx context.Context) error {
	dir := a.cfg.StateDir
	deadline := time.Now().Add(handoverTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	var last error
	for {
		l, err := tryLock(dir)
		if err == nil {
			a.lock = l
			return nil
		}
		if !errors.Is(err, errLocked) {
			return err
		}
		hctx, cancel := context.WithDeadline(ctx, deadline)
		in, err := requestHandover(hctx, dir)
		cancel()
		if err == nil {
			if err := a.compatible(in.state); err != nil {
				in.closeUnused()
				in.lock.release()
				in.conn.Close()
				return err
			}
			a.lock, a.inherit = in.lock, in
			a.setTakingOver(in.from)
			a.log.Info("taking over from the running agent", "pid", in.from)
			return nil
		}
		if !errors.Is(err, errRetry) {
			return err
		}
		last = err
		if time.Now().After(deadline) {
			return fmt.Errorf("another meshdns-ebpf agent holds %s and did not hand over within %v (last: %v); stop it first",
				lockPath(dir), handoverTimeout, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// compatible says whether we can take over from an agent in state st.
func (a *Agent) compatible(st *State) error {
	switch {
	case st.Mode != a.mode:
		return fmt.Errorf("the running agent (pid %d) captures in %s mode and this one would in %s mode: stop it first", st.PID, st.Mode, a.mode)
	case a.mode == ModeEBPF && (st.BPFFS != a.cfg.BPFFS || st.Cgroup != a.cfg.Cgroup):
		return fmt.Errorf("the running agent (pid %d) attaches to %s with pins in %s, this one to %s with pins in %s: stop it first",
			st.PID, st.Cgroup, st.BPFFS, a.cfg.Cgroup, a.cfg.BPFFS)
	case st.Netns != currentNetns():
		return fmt.Errorf("the running agent (pid %d) runs in another network namespace: stop it first", st.PID)
	}
	return nil
}

// takeOverLeftovers removes what a crashed agent left that this one does not
// adopt: another mode's capture, another pin directory's programs. (Pinned
// links and node addresses we use are adopted.)
func (a *Agent) takeOverLeftovers(prev *State) {
	var removed []string
	var errs []error
	if prev.Mode == ModeIptables && a.mode != ModeIptables {
		r, err := ctzone.Cleanup(prev.Backend)
		removed, errs = append(removed, r...), append(errs, err)
	}
	if prev.Mode == ModeEBPF && prev.BPFFS != "" && (a.mode != ModeEBPF || prev.BPFFS != a.cfg.BPFFS) {
		r, err := redirect.Cleanup(prev.BPFFS)
		removed, errs = append(removed, r...), append(errs, err)
	}
	if prev.Netns == currentNetns() {
		removed = append(removed, a.removeUnwantedAddrs(prev)...)
	}
	if err := errors.Join(errs...); err != nil {
		a.log.Warn("could not remove all a previous agent left", "pid", prev.PID, "err", err)
	}
	a.log.Info("a previous agent did not stop cleanly; taking over what it left", "pid", prev.PID, "removed", removed)
}

// removeUnwantedAddrs removes the addresses prev added that we do not listen on.
func (a *Agent) removeUnwantedAddrs(prev *State) []string {
	var drop []NodeAddr
	for _, na := range prev.NodeAddrs {
		if na.Addr == "" {
			continue
		}
		p, err := netip.ParsePrefix(na.Addr)
		if err != nil || slices.ContainsFunc(a.cfg.Listen, func(l netip.AddrPort) bool { return l.Addr() == p.Addr() }) {
			continue
		}
		drop = append(drop, na)
	}
	if len(drop) == 0 {
		return nil
	}
	if err := removeNodeAddrs(drop, a.log); err != nil {
		a.log.Warn("remove a previous agent's address", "err", err)
	}
	var out []string
	for _, d := range drop {
		out = append(out, "address "+d.Addr+" on "+d.Link)
	}
	return out
}

// followReadiness registers the resolver's sockets with the datapath while the
// resolver is ready and unregisters them while it is not.
func (a *Agent) followReadiness() error {
	if a.dp == nil {
		return nil
	}
	notReady := a.store.Ready()
	if notReady == nil {
		notReady = a.srv.Ready()
	}
	ready := notReady == nil
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closing || a.handedOff || ready == a.serving {
		return nil
	}
	if !ready {
		if err := a.dp.Unserve(); err != nil {
			return err
		}
		a.serving = false
		a.log.Warn("resolver not ready: capture off", "reason", notReady)
		return nil
	}
	if err := a.serveSockets(); err != nil {
		return err
	}
	a.serving = true
	a.log.Info("resolver ready: capture on")
	return nil
}

// serveSockets registers one socket per listen address and protocol.
func (a *Agent) serveSockets() error {
	files, err := a.srv.Files()
	if err != nil {
		return err
	}
	defer closeListenerFiles(files)
	var socks []redirect.Socket
	for _, l := range files {
		ap, err := netip.ParseAddrPort(l.Addr)
		if err != nil {
			return fmt.Errorf("resolver listen address %q: %w", l.Addr, err)
		}
		socks = append(socks, redirect.Socket{Addr: ap, Conn: l.UDP[0]}, redirect.Socket{Addr: ap, TCP: true, Conn: l.TCP})
	}
	return a.dp.Serve(socks)
}

func closeListenerFiles(files []resolver.InheritedListener) {
	for _, l := range files {
		for _, f := range l.UDP {
			f.Close()
		}
		if l.TCP != nil {
			l.TCP.Close()
		}
	}
}

func (a *Agent) readinessLoop() {
	defer a.loops.Done()
	t := time.NewTicker(readinessInterval)
	defer t.Stop()
	for {
		select {
		case <-a.stopLoops:
			return
		case <-t.C:
		}
		if err := a.followReadiness(); err != nil {
			a.log.Error("capture readiness", "err", err)
		}
	}
}

// handoverLoop serves successors' requests, one at a time.
func (a *Agent) handoverLoop() {
	defer a.loops.Done()
	for {
		c, err := a.hl.AcceptUnix()
		if err != nil {
			return
		}
		a.handleHandover(c)
	}
}

func (a *Agent) handleHandover(c *net.UnixConn) {
	defer c.Close()
	a.mu.Lock()
	a.hconn = c // shutdown closes it
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.hconn = nil
		a.mu.Unlock()
	}()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	hello, files, err := readMsg(c)
	for _, f := range files {
		f.Close()
	}
	if err != nil || hello.Op != "hello" {
		return
	}
	a.mu.Lock()
	refuse := ""
	switch {
	case a.closing:
		refuse = "stopping"
	case a.handedOff:
		refuse = fmt.Sprintf("already handed over to pid %d", a.successor)
	case a.store.Ready() != nil || a.srv.Ready() != nil:
		refuse = "not ready"
	}
	if refuse != "" {
		a.mu.Unlock()
		_ = writeMsg(c, handoverMsg{Op: "error", Error: refuse}, nil)
		return
	}
	done := make(chan struct{})
	a.handingOver = done
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.handingOver = nil
		a.mu.Unlock()
		close(done)
	}()
	a.log.Info("a successor asks to take over", "pid", hello.PID)
	o := offer{lock: a.lock.f}
	stCopy := *a.st
	o.state = &stCopy
	for _, l := range []struct {
		srv  *adminServer
		file **os.File
	}{{a.admin, &o.admin}, {a.local, &o.local}} {
		if l.srv == nil {
			continue
		}
		if *l.file, err = l.srv.File(); err != nil {
			a.log.Error("handover: admin listener", "addr", l.srv.addr, "err", err)
			_ = writeMsg(c, handoverMsg{Op: "error", Error: err.Error()}, nil)
			return
		}
		defer (*l.file).Close()
	}
	if o.listeners, err = a.srv.Files(); err != nil {
		a.log.Error("handover: resolver sockets", "err", err)
		_ = writeMsg(c, handoverMsg{Op: "error", Error: err.Error()}, nil)
		return
	}
	defer closeListenerFiles(o.listeners)
	_ = c.SetDeadline(time.Now().Add(handoverTimeout))
	if a.cfg.handoverFault == "predecessor" {
		o.dieAfterSend = true
	}
	succ, err := sendOffer(c, o)
	if err != nil {
		a.log.Warn("handover failed; serving on", "successor", hello.PID, "err", err)
		a.reassert()
		return
	}
	a.mu.Lock()
	a.handedOff, a.successor = true, succ
	a.mu.Unlock()
	a.log.Info("handed over to the successor; draining", "pid", succ)
	go a.shutdown(true)
}

// reassert puts our programs, configuration, sockets and state back after a
// successor failed to take over (it may have replaced some of them).
func (a *Agent) reassert() {
	if a.dp != nil {
		if err := a.dp.Reassert(); err != nil {
			a.log.Error("restore the datapath after a failed handover", "err", err)
		}
		a.mu.Lock()
		if a.serving {
			if err := a.serveSockets(); err != nil {
				a.log.Error("register the resolver sockets again after a failed handover", "err", err)
			}
		}
		a.mu.Unlock()
	}
	if err := a.save(); err != nil {
		a.log.Error("restore the state file after a failed handover", "err", err)
	}
}

// Close stops the agent. Without a successor: capture goes off first (queries go
// to their original nameserver), the resolver answers what was already sent to
// it, then everything is removed (the eBPF programs stay attached and pinned,
// inert, for the next agent, unless --persist=false). After a handover it only
// waits until this process has drained and released its descriptors. A
// handover in progress is waited for. Idempotent; safe after a failed Start.
func (a *Agent) Close() error {
	a.mu.Lock()
	running := a.handingOver
	a.mu.Unlock()
	if running != nil {
		select {
		case <-running:
		case <-time.After(handoverTimeout):
		}
	}
	a.mu.Lock()
	handoff := a.handedOff
	a.mu.Unlock()
	if !handoff {
		a.followLifecycle()
		a.mu.Lock()
		handoff = a.handedOff
		a.mu.Unlock()
	}
	a.shutdown(handoff)
	<-a.shutDone
	return a.shutErr
}

// shutdown releases everything once; see Close.
func (a *Agent) shutdown(handoff bool) {
	a.shutOnce.Do(func() {
		defer close(a.shutDone)
		log := a.log
		var errs []error
		add := func(what string, err error) {
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", what, err))
			}
		}
		a.mu.Lock()
		a.closing = true
		if a.hconn != nil {
			a.hconn.Close()
		}
		a.mu.Unlock()
		if a.hl != nil {
			a.hl.Close()
			if !handoff {
				_ = os.Remove(handoverPath(a.cfg.StateDir))
			}
		}
		close(a.stopLoops)
		a.loops.Wait()
		if a.liveClose != nil {
			add("liveness probe socket", a.liveClose())
		}
		if handoff {
			for _, h := range []interface{ Handoff() }{a.dp, a.rules, a.nodes} {
				if h != nil && !isNilHandoff(h) {
					h.Handoff()
				}
			}
		} else {
			if a.uninstall && a.dp != nil {
				a.dp.DetachOnClose()
			}
			log.Info("stopping: capture off, then the resolver drains")
			if a.dp != nil {
				add("capture off", a.dp.Unserve())
			}
			if a.rules != nil {
				add("remove iptables capture", a.rules.StopCapture())
			}
		}
		if a.srv != nil {
			quiet := drainQuiet
			if handoff {
				quiet = 0 // the successor reads the shared sockets: stop at once
			}
			ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
			add("drain the resolver", a.srv.Drain(ctx, quiet))
			cancel()
		}
		if a.dp != nil {
			add("eBPF datapath", a.dp.Close())
		}
		if a.rules != nil {
			add("iptables capture", a.rules.Close())
		}
		if a.fwd != nil {
			add("upstream", a.fwd.Close())
		}
		add("workload names and top talkers", a.work.Close())
		if a.store != nil {
			add("name sources", a.store.Close())
		}
		if a.nodes != nil {
			add("node address", a.nodes.Close())
		}
		add("admin server", a.admin.Close())
		add("local admin socket", a.local.Close())
		if a.local != nil && !handoff {
			add("local admin socket", removeFile(a.local.addr))
		}
		if a.st != nil && !handoff {
			add("state file", removeState(a.cfg.StateDir))
		}
		add("lifecycle watch", a.life.Close())
		if a.uninstall && !handoff {
			add("state dir", removeStateDir(a.cfg.StateDir))
		}
		add("state lock", a.lock.release())
		a.shutErr = errors.Join(errs...)
		for _, e := range errs {
			log.Error("stop", "err", e)
		}
		switch {
		case handoff && a.successor != 0:
			log.Info("handed over and drained; waiting for SIGTERM", "successor", a.successor)
		case handoff:
			log.Info("gave up taking over; the running agent serves on")
		default:
			log.Info("stopped")
		}
	})
}

// isNilHandoff reports whether h holds a nil pointer (an unused part).
func isNilHandoff(h interface{ Handoff() }) bool {
	switch p := h.(type) {
	case *redirect.Datapath:
		return p == nil
	case *ctzone.Rules:
		return p == nil
	case *nodeAddrs:
		return p == nil
	}
	return false
}

// abort undoes a failed Start. Taking over from a running agent, it leaves that
// agent's state alone (the datapath's pins, rules, addresses it adopted) and
// closes only its own descriptors: the predecessor notices and serves on.
func (a *Agent) abort() {
	if in := a.inherit; in != nil {
		if a.dp != nil {
			a.dp.Handoff()
		}
		if a.rules != nil {
			a.rules.Handoff()
		}
		if a.nodes != nil {
			_ = a.nodes.abandon()
			a.nodes = nil
		}
		a.st = nil // the predecessor's state file stays
		in.closeUnused()
		in.conn.Close()
		a.mu.Lock()
		a.handedOff = true // nothing of the node's state is ours
		a.mu.Unlock()
	} else if a.dp != nil {
		a.dp.Discard() // leave nothing attached that was not before
	}
	a.shutdown(a.inherit != nil)
	<-a.shutDone
}
