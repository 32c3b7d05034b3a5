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
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/budgetoverride"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/handover"
	"github.com/meshdns/meshdns-ebpf/internal/kubelife"
	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/meshsource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nodeaddr"
	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
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
	plan      *startPlan // resolved first; read-only after
	lock      *agentstate.Lock
	inherit   *handover.Inheritance
	st        *agentstate.State
	nodes     *nodeaddr.Set
	store     *names.Store
	pods      *kubesource.Source         // the Kubernetes source: this node's Pods (nil without)
	entries   *meshsource.ServiceEntries // the ServiceEntry source (nil without)
	work      *workloads
	fwd       *upstream.Forwarder
	srv       *resolver.Server
	panics    *panicguard.Counter // panics recovered on the query path (resolver and upstream)
	gc        *gcControl          // GOGC
	dp        *redirect.Datapath
	egress    *egressPart // DNS-gated egress (--egress; nil without)
	rules     *ctzone.Rules
	live      *liveness    // the resolver's liveness (/healthz)
	liveClose func() error // closes the liveness probe's socket
	admin     *adminServer // the admin address
	local     *adminServer // the local socket in the state dir
	hl        *net.UnixListener
	life      *kubelife.Watch // the agent's own pod, DaemonSet and namespace (Kubernetes)
	stopLoops chan struct{}
	loops     sync.WaitGroup

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
// handover.Timeout). Every error it returns leaves nothing behind that was not
// there before, and a predecessor it was taking over from serves on.
//
// The steps, in order: resolve the plan (nothing is acquired before it is
// complete), prepare the host; start what changes nothing of the node's
// state: the name sources, the workload names, the upstream forwarder, and
// load the eBPF programs (a successor does this while its predecessor still
// serves, so that the sockets it takes over wait little for it); take the
// state lock or the running agent's descriptors, record the state, put the
// node address in place, then attach the eBPF datapath and start DNS-gated
// egress, the resolver, the iptables capture and the admin endpoints; capture
// follows the resolver's readiness, and a takeover ends by telling the
// predecessor that this agent serves.
func (a *Agent) Start(ctx context.Context) (err error) {
	if err := a.markStarted(); err != nil {
		return err
	}
	defer func() {
		if err != nil {
			a.abort()
		}
	}()
	a.tuneRuntime()
	if a.plan, err = a.cfg.resolvePlan(ctx, a.log); err != nil {
		return err
	}
	if err := a.prepareHost(); err != nil {
		return err
	}
	reg := a.newRegistry()
	if err := a.runSteps(ctx, reg, a.startNames, a.startWorkloads, a.startUpstream, a.loadDatapath); err != nil {
		return err
	}
	prev, err := a.acquireState(ctx)
	if err != nil {
		return err
	}
	if err := a.startNodeAddrs(ctx, prev); err != nil {
		return err
	}
	if err := a.runSteps(ctx, reg, a.startDatapath, a.startEgress, a.startResolver, a.startIptables, a.startAdmin); err != nil {
		return err
	}
	// Capture on, as soon as the resolver is ready (at once, normally: the name
	// table's first load is done).
	if err := a.followReadiness(); err != nil {
		return err
	}
	if err := a.serveSuccessors(prev); err != nil {
		return err
	}
	a.startLoops()
	p := a.plan
	a.log.Info("meshdns-ebpf running", "mode", p.mode, "reason", p.reason, "listen", p.listenAddrs,
		"nameservers", a.st.Nameservers, "capture_all", a.cfg.CaptureAll, "upstreams", a.st.Upstreams,
		"cgroup", p.cgroup)
	return nil
}

// runSteps runs start steps in order, up to the first that fails.
func (a *Agent) runSteps(ctx context.Context, reg *prometheus.Registry, steps ...func(context.Context, *prometheus.Registry) error) error {
	for _, step := range steps {
		if err := step(ctx, reg); err != nil {
			return err
		}
	}
	return nil
}

// tuneRuntime sets the Go memory limit and starts following the live heap
// with GOGC.
func (a *Agent) tuneRuntime() {
	tuneMemoryLimit(&a.cfg, a.log)
	a.gc = newGCControl()
	a.gc.start()
}

// markStarted makes Start a one-time call.
func (a *Agent) markStarted() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.started {
		return errors.New("agent already started")
	}
	a.started = true
	return nil
}

// prepareHost makes sure the eBPF mode's pin directory has a bpffs.
func (a *Agent) prepareHost() error {
	if a.plan.mode != ModeEBPF {
		return nil
	}
	mounted, err := ensureBPFFS(a.cfg.BPFFS)
	if err != nil {
		return err
	}
	if mounted {
		a.log.Info("mounted bpffs", "path", filepath.Dir(a.cfg.BPFFS))
	}
	return nil
}

// acquireState takes the state lock, or the running agent's descriptors (its
// lock among them), removes what a crashed agent left that this one does not
// adopt, and writes the state file before anything is installed. It returns
// the previous agent's state (nil: none).
func (a *Agent) acquireState(ctx context.Context) (prev *agentstate.State, err error) {
	if a.plan.mode != ModeOff {
		if prev, err = a.acquirePrevious(ctx); err != nil {
			return nil, err
		}
	}
	a.st = a.newState()
	if a.plan.mode == ModeEBPF {
		a.reportBPFFS()
	}
	// The state file is written before anything is installed and again after each
	// step, so that `cleanup` after a crash at any point knows what to remove. In a
	// handover the predecessor's file stays until we serve.
	if a.plan.mode != ModeOff && a.inherit == nil {
		if err := a.save(); err != nil {
			return nil, err
		}
	}
	return prev, nil
}

// newState is the state file's content at start.
func (a *Agent) newState() *agentstate.State {
	cfg, p := &a.cfg, a.plan
	st := &agentstate.State{
		PID: os.Getpid(), Mode: p.mode, ModeReason: p.reason, CaptureAll: cfg.CaptureAll,
		Admin: cfg.Admin, Persist: cfg.Persist, Started: time.Now().UTC(), Netns: agentstate.Netns(),
		Listen: p.listenAddrs,
	}
	if p.mode != ModeOff {
		st.SlotPorts = p.ports
	}
	if a.inherit != nil {
		st.Predecessor = a.inherit.From
	}
	if p.mode == ModeEBPF {
		st.Cgroup, st.BPFFS = p.cgroup, cfg.BPFFS
	}
	for _, n := range p.nameservers {
		st.Nameservers = append(st.Nameservers, n.String())
	}
	for _, u := range p.upstreams {
		st.Upstreams = append(st.Upstreams, u.String())
	}
	return st
}

// startNodeAddrs puts the resolver's node-local addresses in place (adopting
// those a previous agent in this network namespace added).
func (a *Agent) startNodeAddrs(ctx context.Context, prev *agentstate.State) error {
	if a.plan.mode == ModeOff {
		return nil
	}
	var want []netip.Addr
	for _, l := range a.cfg.Listen {
		want = append(want, l.Addr())
	}
	var adopt []agentstate.NodeAddr
	if prev != nil && prev.Netns == agentstate.Netns() {
		adopt = prev.NodeAddrs
	}
	a.nodes = nodeaddr.New(want, a.cfg.LinkName, adopt, a.log)
	if err := a.nodes.Start(ctx); err != nil {
		return err
	}
	a.st.NodeAddrs = a.nodes.Records()
	if a.inherit == nil {
		return a.save()
	}
	return nil
}

// newRegistry is the metrics registry every component registers with.
func (a *Agent) newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(newBuildInfo())
	reg.MustRegister(a.newStateMetrics(a.plan.mode)...)
	a.panics, _ = panicguard.New(nil, a.log.With("component", "resolver")) // no registerer: no error
	reg.MustRegister(a.panics)
	return reg
}

// startNames starts the name sources and the store that merges them into
// the name table (and the watch of the agent's own pod, DaemonSet and
// namespace).
func (a *Agent) startNames(ctx context.Context, reg *prometheus.Registry) (err error) {
	kubeRest := a.plan.kubeRest
	if a.store, a.pods, a.entries, err = a.cfg.newNameStore(reg, kubeRest, a.gc.largeChange, a.log); err != nil {
		return err
	}
	if err := a.store.Start(ctx); err != nil {
		return fmt.Errorf("start name sources: %w", err)
	}
	if kubeRest != nil && a.plan.mode != ModeOff {
		a.watchLifecycle(ctx, kubeRest)
	}
	return nil
}

// startWorkloads starts who-asked: workload names, top talkers, the tap.
func (a *Agent) startWorkloads(ctx context.Context, reg *prometheus.Registry) (err error) {
	var pods workload.PodIndex
	if a.pods != nil {
		pods = a.pods
	}
	if a.work, err = a.cfg.newWorkloads(pods, reg); err != nil {
		return err
	}
	return a.work.Start(ctx)
}

// startUpstream starts the upstream forwarder.
func (a *Agent) startUpstream(ctx context.Context, reg *prometheus.Registry) (err error) {
	ucfg := upstream.NewConfig(a.plan.upstreams...)
	ucfg.Mark = a.cfg.UpstreamMark
	ucfg.CacheBytes = a.cfg.CacheBytes
	ucfg.CacheWorkloadBytes = a.cfg.CacheWorkloadBytes // 0: a share of CacheBytes
	ucfg.Registerer = reg
	ucfg.Logger = a.log.With("component", "upstream")
	ucfg.Panics = a.panics
	if a.plan.mode == ModeOff {
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
	return nil
}

// loadDatapath loads the eBPF programs (eBPF mode): the verifier's work,
// which changes nothing the running programs see.
func (a *Agent) loadDatapath(ctx context.Context, _ *prometheus.Registry) (err error) {
	if a.plan.mode != ModeEBPF {
		return nil
	}
	if a.dp, err = redirect.New(a.cfg.redirectConfig(a.plan, a.log)); err != nil {
		return fmt.Errorf("eBPF datapath: %w", err)
	}
	if err := a.dp.Load(ctx); err != nil {
		return fmt.Errorf("load eBPF datapath: %w", err)
	}
	return nil
}

// startDatapath installs the loaded eBPF datapath (eBPF mode). It comes before the
// resolver: it adopts the pinned links (a predecessor's programs are
// replaced in place) before the resolver counts its progress.
func (a *Agent) startDatapath(ctx context.Context, reg *prometheus.Registry) (err error) {
	if a.dp == nil {
		return nil
	}
	if err := a.dp.Start(ctx); err != nil {
		return fmt.Errorf("install eBPF datapath: %w", err)
	}
	reg.MustRegister(newDatapathCollector(a.dp.HookStats), newForeignProgramsCollector(a.dp.CgroupPrograms),
		newCaptureMechanismCollector(a.dp.HookCaptures))
	a.watchDNSBackends()
	return nil
}

// startResolver starts the resolver, on the predecessor's sockets when there
// is one (GOMAXPROCS is raised for its readers before they start), and its
// liveness monitor.
func (a *Agent) startResolver(ctx context.Context, reg *prometheus.Registry) (err error) {
	cfg := &a.cfg
	rc := resolver.Config{
		Listen:         a.plan.listenAddrs,
		Table:          a.store,
		Forwarder:      cfg.forwarder(a.fwd),
		PodRecords:     cfg.PodRecords,
		FilterAAAA:     cfg.FilterAAAA,
		TTL:            cfg.TTL,
		ClusterDomain:  cfg.ClusterDomain,
		Authoritative:  cfg.Authoritative,
		MaxPending:     cfg.MaxPending,
		WorkloadBudget: cfg.WorkloadBudget,
		MaxTCPConns:    cfg.MaxTCPConns,
		Registerer:     reg,
		Logger:         a.log.With("component", "resolver"),
		OnReaders:      func(blocking int) { tuneProcs(blocking, a.log) },
		ReaderNice:     readerNice,
		Panics:         a.panics,
	}
	var flows *redirect.Flows
	if a.dp != nil {
		rc.OnDequeue = a.dp.Dequeued
		flows = a.dp.Flows()
	}
	a.work.configure(&rc, flows, a.egress != nil)
	if a.egress != nil {
		rc.Grant = a.egress.ctl.Grant
	}
	if a.pods != nil {
		// Budgets of their own for pods and namespaces that ask for one
		// (meshdns.io/upstream-* annotations).
		ov := budgetoverride.New(cfg.WorkloadBudget, a.pods, a.work.namer, a.log.With("component", "budgets"))
		reg.MustRegister(ov)
		rc.BudgetOverrides = ov
	}
	if a.inherit != nil {
		rc.Inherited, a.inherit.Listeners = a.inherit.Listeners, nil
	}
	if a.srv, err = resolver.New(rc); err != nil {
		return fmt.Errorf("resolver: %w", err)
	}
	if err := a.srv.Start(ctx); err != nil {
		return fmt.Errorf("start resolver: %w", err)
	}
	return a.watchLiveness()
}

// startIptables installs the iptables capture (iptables mode).
func (a *Agent) startIptables(ctx context.Context, _ *prometheus.Registry) (err error) {
	if a.plan.mode != ModeIptables {
		return nil
	}
	if a.rules, err = ctzone.New(a.cfg.ctzoneConfig(a.plan, a.log)); err != nil {
		return fmt.Errorf("iptables capture: %w", err)
	}
	if err := a.rules.Start(ctx); err != nil {
		return fmt.Errorf("install iptables capture: %w", err)
	}
	a.st.Backend = a.rules.Backend()
	return nil
}

// startLoops starts the loops that run until shutdown: capture follows
// readiness, liveness is watched, successors are served.
func (a *Agent) startLoops() {
	a.loops.Add(2)
	go a.readinessLoop()
	go a.livenessLoop()
	if a.hl != nil {
		a.loops.Add(1)
		go a.handoverLoop()
	}
}

// setTakingOver records the predecessor this agent takes over from (0: none).
func (a *Agent) setTakingOver(pid int) {
	a.mu.Lock()
	a.takingOver = pid
	a.mu.Unlock()
}

func (a *Agent) save() error {
	if a.st == nil {
		return nil
	}
	return agentstate.Write(a.cfg.StateDir, a.st)
}
