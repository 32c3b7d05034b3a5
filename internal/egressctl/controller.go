// Package egressctl joins DNS-gated egress's policy (internal/egresspolicy) to
// its datapath (internal/egress). It decides which cgroups of this node the
// policies select (pods by namespace and labels, a VM's systemd units or
// cgroup paths), gives each a workload id and writes the rule the programs
// enforce for it; and for every answer a selected workload receives it grants
// the answer's addresses on the ports its policy opens for the name, before
// the resolver releases the reply (Grant).
//
// Data flows one way: policy sources publish Sets, the pod list and the cgroup
// tree are read at each sync, and the controller writes the datapath. The
// resolver reads the published workload → policy table without a lock.
package egressctl

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Datapath is what the controller writes: internal/egress implements it.
type Datapath interface {
	Enable(on bool) error
	SetWorkload(cgroupID uint64, id egress.WorkloadID, r egress.Rule) error
	RemoveWorkload(cgroupID uint64) error
	SetInternal(prefixes []netip.Prefix) error
}

// Granter writes grants: (*egress.Grants) implements it.
type Granter interface {
	Grant(wl egress.WorkloadID, name string, addrs []netip.Addr, ports []egress.Port, ttl time.Duration) error
}

// Pod is a pod of this node as the controller selects it.
type Pod struct {
	Namespace, Name, UID string
	Labels               map[string]string
}

// DefaultResync is how often the controller looks for new pod cgroups without
// being told of a change.
const DefaultResync = 2 * time.Second

// DefaultSettle bounds how long a restarted controller keeps what a previous
// agent left while its sources have not all published.
const DefaultSettle = 30 * time.Second

// Config configures a Controller. Every field but Logger, Pods, Adopted and
// Resync is required.
type Config struct {
	Datapath Datapath
	Grants   Granter
	// CgroupRoot is the cgroup2 directory (the captured subtree) where pods'
	// cgroups are looked for.
	CgroupRoot string
	// UnitRoot is the cgroup2 mount, where a unit's cgroup is looked for
	// (system.slice/<unit>, else anywhere below); "": CgroupRoot. A policy's
	// cgroup path is absolute and used as it is.
	UnitRoot string
	// Pods lists this node's pods (nil: no Kubernetes, VM units only).
	Pods func() []Pod
	// Internal are the cluster-internal prefixes (Pod and Service CIDRs),
	// allowed without a grant unless a policy puts them in scope.
	Internal []netip.Prefix
	// Adopted are the workloads a previous agent left in the pinned maps
	// (cgroup id → workload id): kept, so their live grants stay valid.
	Adopted map[uint64]egress.WorkloadID
	// Resync is how often the cgroup tree is looked at again (0: DefaultResync).
	Resync time.Duration
	// Expect are the sources whose first policies must arrive before the
	// controller removes a workload it did not select itself (one a previous
	// agent left) or switches enforcement off: a restarted agent that has not
	// heard from its sources yet must not unselect workloads and drop their
	// grants. After Settle (0: DefaultSettle) it acts on what it has.
	Expect []string
	Settle time.Duration
	Logger *slog.Logger
}

// Controller is the egress controller of one agent (New/Start/Close).
type Controller struct {
	cfg Config
	log *slog.Logger

	kick  chan struct{}
	watch *cgroupWatch // from Start: wakes the loop when a workload's cgroup is made
	stop  context.CancelFunc
	done  sync.WaitGroup

	created   time.Time
	published chan struct{} // closed once every expected source has published

	mu      sync.Mutex
	sets    map[string]*egresspolicy.Set // by source
	applied map[uint64]applied           // cgroup id → what the datapath has
	nextID  egress.WorkloadID
	errs    atomic.Int64 // sync failures

	granted, notAllowed, grantErrs atomic.Int64 // Grant's results

	// byID is what Grant reads: workload id → its policy and name.
	byID atomic.Pointer[map[egress.WorkloadID]*Selected]
	// unallowed remembers, per workload, the names it was answered but may
	// not use, by address: a denied connect is shown with the name.
	unallowed unallowedNames
}

// Selected is one selected workload: its policy and who it is.
type Selected struct {
	ID       egress.WorkloadID
	Cgroup   uint64
	Path     string
	Workload string // "namespace/pod" or the unit
	Policy   *egresspolicy.Policy
}

type applied struct {
	id   egress.WorkloadID
	rule egress.Rule
	sel  *Selected
}

// New checks cfg. It touches nothing.
func New(cfg Config) (*Controller, error) {
	switch {
	case cfg.Datapath == nil || cfg.Grants == nil:
		return nil, errors.New("egressctl: no datapath or grants")
	case cfg.CgroupRoot == "":
		return nil, errors.New("egressctl: no cgroup root")
	case cfg.Resync < 0 || cfg.Settle < 0:
		return nil, fmt.Errorf("egressctl: negative resync %v or settle %v", cfg.Resync, cfg.Settle)
	}
	if cfg.Resync == 0 {
		cfg.Resync = DefaultResync
	}
	if cfg.Settle == 0 {
		cfg.Settle = DefaultSettle
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Controller{cfg: cfg, log: log, kick: make(chan struct{}, 1), sets: map[string]*egresspolicy.Set{},
		applied: map[uint64]applied{}, nextID: 1, created: time.Now(), published: make(chan struct{})}
	if len(cfg.Expect) == 0 {
		close(c.published)
	}
	c.unallowed.init()
	for cg, id := range cfg.Adopted {
		c.applied[cg] = applied{id: id}
		c.nextID = max(c.nextID, id+1)
	}
	empty := map[egress.WorkloadID]*Selected{}
	c.byID.Store(&empty)
	return c, nil
}

// Start writes the internal prefixes, syncs once and keeps syncing on every
// change (SetPolicies, PodsChanged) and every Resync.
func (c *Controller) Start(ctx context.Context) error {
	if err := c.cfg.Datapath.SetInternal(c.cfg.Internal); err != nil {
		return fmt.Errorf("egressctl: internal prefixes: %w", err)
	}
	c.watch = newCgroupWatch(c.log)
	if err := c.Sync(); err != nil {
		c.watch.close()
		return err
	}
	ctx, c.stop = context.WithCancel(ctx)
	c.done.Add(2)
	go c.loop(ctx)
	go func() {
		defer c.done.Done()
		c.watch.run(ctx, c.PodsChanged)
	}()
	return nil
}

// Close stops the syncing. What the datapath holds stays (the pinned maps
// keep enforcing for the next agent).
func (c *Controller) Close() error {
	if c.stop != nil {
		c.stop()
	}
	c.done.Wait()
	if c.watch != nil {
		c.watch.close()
	}
	return nil
}

func (c *Controller) loop(ctx context.Context) {
	defer c.done.Done()
	t := time.NewTicker(c.cfg.Resync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.kick:
		case <-t.C:
		}
		if err := c.Sync(); err != nil {
			c.log.Warn("egress: sync", "err", err)
		}
	}
}

// SetPolicies replaces one source's policies ("kubernetes", "istio", "file")
// and syncs soon.
func (c *Controller) SetPolicies(source string, s *egresspolicy.Set) {
	c.mu.Lock()
	c.sets[source] = s
	if c.allExpectedLocked() {
		select {
		case <-c.published:
		default:
			close(c.published)
		}
	}
	c.mu.Unlock()
	c.PodsChanged()
}

// allExpectedLocked reports whether every expected source has published.
func (c *Controller) allExpectedLocked() bool {
	for _, src := range c.cfg.Expect {
		if _, ok := c.sets[src]; !ok {
			return false
		}
	}
	return true
}

// WaitPublished waits until every expected source has published its first
// policies, or ctx ends; it reports whether they have. The agent waits for it
// before its resolver serves, so that answers to selected workloads are granted
// by their policy from the first.
func (c *Controller) WaitPublished(ctx context.Context) bool {
	select {
	case <-c.published:
		return true
	case <-ctx.Done():
		return false
	}
}

// settled reports whether the controller may act on what it has: every
// expected source has published, or Settle has passed.
func (c *Controller) settled() bool {
	select {
	case <-c.published:
		return true
	default:
		return time.Since(c.created) >= c.cfg.Settle
	}
}

// PodsChanged asks for a sync soon (a pod came, went or changed labels).
func (c *Controller) PodsChanged() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// Errors is how many syncs failed.
func (c *Controller) Errors() int64 { return c.errs.Load() }

// Selected returns the selected workloads, by workload id.
func (c *Controller) Selected() []*Selected {
	m := *c.byID.Load()
	out := slices.Collect(maps.Values(m))
	slices.SortFunc(out, func(a, b *Selected) int { return int(a.ID) - int(b.ID) })
	return out
}

// Sync selects the cgroups every policy selects now and writes the
// difference to the datapath: new and changed workloads first, then the ones
// no policy selects any more.
func (c *Controller) Sync() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	set, err := c.mergedLocked()
	if err != nil {
		c.errs.Add(1)
		return err
	}
	sel, err := c.selectLocked(set)
	if err != nil {
		c.errs.Add(1)
		return err
	}
	if c.watch != nil && c.watch.set(sel.dirs, sel.units) {
		c.PodsChanged() // a cgroup made before its directory was watched
	}
	want := sel.want
	var errs []error
	if set.Len() > 0 {
		errs = append(errs, c.cfg.Datapath.Enable(true))
	}
	byID := map[egress.WorkloadID]*Selected{}
	for cg, sel := range want {
		a, ok := c.applied[cg]
		if a.id == 0 {
			a.id = c.nextID
			c.nextID++
		}
		sel.ID = a.id
		r := ruleOf(sel.Policy)
		if !ok || a.sel == nil || a.rule != r {
			if err := c.cfg.Datapath.SetWorkload(cg, a.id, r); err != nil {
				errs = append(errs, err)
				continue
			}
		}
		c.applied[cg] = applied{id: a.id, rule: r, sel: sel}
		byID[a.id] = sel
	}
	settled := c.settled()
	for cg, a := range c.applied {
		if _, ok := want[cg]; ok {
			continue
		}
		if !settled {
			// Not heard from every source yet: keep it (a previous agent's
			// workload keeps its rule, its id and its grants).
			if a.sel != nil {
				byID[a.id] = a.sel
			}
			continue
		}
		if err := c.cfg.Datapath.RemoveWorkload(cg); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(c.applied, cg)
		c.unallowed.forget(a.id)
	}
	c.byID.Store(&byID)
	if set.Len() == 0 && len(c.applied) == 0 && settled {
		errs = append(errs, c.cfg.Datapath.Enable(false))
	}
	if err := errors.Join(errs...); err != nil {
		c.errs.Add(1)
		return fmt.Errorf("egressctl: sync: %w", err)
	}
	return nil
}

// mergedLocked is every source's policies as one Set.
func (c *Controller) mergedLocked() (*egresspolicy.Set, error) {
	var all []egresspolicy.Policy
	for _, src := range slices.Sorted(maps.Keys(c.sets)) {
		for _, p := range c.sets[src].Policies() {
			all = append(all, *p)
		}
	}
	s, err := egresspolicy.NewSet(all)
	if err != nil {
		return nil, fmt.Errorf("egressctl: merge policy sources: %w", err)
	}
	return s, nil
}

// selection is what a sync selects, and where the cgroups of the workloads it
// selects are made (watched until the next sync).
type selection struct {
	want  map[uint64]*Selected // by cgroup id
	dirs  []string             // the directories where pods' and units' cgroups are made
	units map[string]bool      // the base names of the units' cgroups
}

// selectLocked finds the cgroup of every selected pod and unit.
func (c *Controller) selectLocked(set *egresspolicy.Set) (selection, error) {
	sel := selection{want: map[uint64]*Selected{}, units: map[string]bool{}}
	if set.Len() == 0 {
		return sel, nil
	}
	if c.cfg.Pods != nil {
		tree, err := workload.PodCgroups(c.cfg.CgroupRoot)
		if err != nil {
			return selection{}, err
		}
		sel.dirs = tree.Parents
		for _, p := range c.cfg.Pods() {
			cg, ok := tree.Pods[p.UID]
			if !ok {
				continue // not started yet: the watch or the next sync finds it
			}
			if pol, ok := set.Select(egresspolicy.Workload{Namespace: p.Namespace, Labels: p.Labels}); ok {
				sel.want[cg.ID] = &Selected{Cgroup: cg.ID, Path: cg.Path, Workload: p.Namespace + "/" + p.Name, Policy: pol}
			}
		}
	}
	units := map[string]bool{}
	for _, p := range set.Policies() {
		if p.Unit != "" {
			units[p.Unit] = true
		}
	}
	for unit := range units {
		cg, ok := c.unitCgroup(unit)
		sel.units[filepath.Base(unit)] = true
		sel.dirs = append(sel.dirs, c.unitParent(unit, cg, ok))
		if !ok {
			continue // not running
		}
		if pol, ok := set.Select(egresspolicy.Workload{Unit: unit}); ok {
			sel.want[cg.ID] = &Selected{Cgroup: cg.ID, Path: cg.Path, Workload: unit, Policy: pol}
		}
	}
	return sel, nil
}

// unitParent is the directory where a unit's cgroup is made: the found
// cgroup's parent, else the parent of its path or system.slice.
func (c *Controller) unitParent(unit string, cg workload.Cgroup, found bool) string {
	switch {
	case found:
		return filepath.Dir(cg.Path)
	case strings.HasPrefix(unit, "/"):
		return filepath.Dir(filepath.Clean(unit))
	default:
		return filepath.Join(cmp.Or(c.cfg.UnitRoot, c.cfg.CgroupRoot), "system.slice")
	}
}

// unitCgroup finds a unit's cgroup: an absolute cgroup directory
// ("/sys/fs/cgroup/app.slice") or a unit name, looked for in system.slice and
// anywhere below the unit root.
func (c *Controller) unitCgroup(unit string) (workload.Cgroup, bool) {
	root := cmp.Or(c.cfg.UnitRoot, c.cfg.CgroupRoot)
	if strings.HasPrefix(unit, "/") {
		return workload.CgroupAt(filepath.Clean(unit))
	}
	if cg, ok := workload.CgroupAt(filepath.Join(root, "system.slice", unit)); ok {
		return cg, true
	}
	var found workload.Cgroup
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error { //nolint:errcheck // a partial walk finds less
		if err != nil {
			return nil
		}
		if !d.IsDir() {
			return nil
		}
		if d.Name() == unit {
			found, _ = workload.CgroupAt(p)
			return filepath.SkipAll
		}
		return nil
	})
	return found, found.ID != 0
}

// ruleOf is what the datapath enforces for a policy.
func ruleOf(p *egresspolicy.Policy) egress.Rule {
	return egress.Rule{
		Enforce:         p.Mode == egresspolicy.Enforce,
		FailClosed:      p.FailMode == egresspolicy.FailClosed,
		InternalInScope: p.ClusterInternal,
	}
}
