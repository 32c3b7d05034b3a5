// Package egress is the datapath half of DNS-gated egress: it writes the
// egress maps of internal/redirect's programs (bpf/redirect.c, "DNS-gated
// egress") and reads back what they decided.
//
// A workload is a selected cgroup (a pod's cgroup, a VM's unit) with a
// [WorkloadID] and a [Rule]; the programs find a task's workload by walking its
// cgroup's ancestors, so containers created later inside a selected cgroup are
// covered. A connect or send to a port other than 53 from a workload is allowed
// by a live grant of its destination ([Grants.Grant], written by the resolver
// before the answer that resolved the address leaves), by an internal prefix
// ([Egress.SetInternal]) unless the rule puts internal destinations in scope,
// or, for a fail-open rule, while no agent serves; otherwise it is denied with
// EPERM (enforce) or allowed and recorded (audit). [Egress.Counts] reads the
// per-workload counters, [Egress.Events] the denied and audited connects.
//
// The maps are pinned with the datapath's: grants keep working while the agent
// is down and pass to the next agent, which adopts them (Start rebuilds the
// quota bookkeeping from the pinned grants).
//
// Lifecycle: [New] validates, [Egress.Start] takes the maps of a started
// [redirect.Datapath], [Egress.Close] stops the readers (the maps stay).
package egress

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// WorkloadID names a selected cgroup's workload in the maps; never 0.
type WorkloadID uint32

// Rule is what the programs enforce for a workload.
type Rule struct {
	Enforce         bool // deny what no grant allows; false: audit (allow and record)
	FailClosed      bool // keep enforcing while no agent serves; false: allow everything then
	InternalInScope bool // internal destinations (SetInternal) need a grant too
}

func (r Rule) flags() uint32 {
	var f uint32
	if r.Enforce {
		f |= redirect.EgressEnforce
	}
	if r.FailClosed {
		f |= redirect.EgressFailClosed
	}
	if r.InternalInScope {
		f |= redirect.EgressInternalInScope
	}
	return f
}

// Proto is a grant's transport protocol; ProtoAny matches both.
type Proto uint8

// Protocols a grant can name.
const (
	ProtoAny Proto = 0
	ProtoTCP Proto = 6
	ProtoUDP Proto = 17
)

// Port is one (port, protocol) a grant allows; Port 0 is any port.
type Port struct {
	Port  uint16
	Proto Proto
}

// DefaultGrace is added to every grant's TTL: a client that connects as its
// answer expires (or a little after, its clock and ours apart) still may.
const DefaultGrace = 5 * time.Second

// DefaultSweep is how often expired grants are removed from the map.
const DefaultSweep = time.Second

// DefaultEventBuffer is how many events wait in the Events channel.
const DefaultEventBuffer = 1024

// Config configures an Egress.
type Config struct {
	Datapath *redirect.Datapath // started before Start; its maps are used
	// Grace is added to each grant's TTL (0: DefaultGrace).
	Grace time.Duration
	// Quota is the most grants one workload holds (0: a sixteenth of the
	// grant cap, at least 1). Over it, the workload's grant closest to expiry
	// (an expired one first) gives way.
	Quota int
	// Sweep is how often expired grants are removed (0: DefaultSweep).
	Sweep time.Duration
	// EventBuffer is the capacity of the Events channel (0:
	// DefaultEventBuffer); an event that finds it full is dropped and
	// counted (EventsLost).
	EventBuffer int
	Logger      *slog.Logger // nil: discard
}

// Egress owns the egress maps of one datapath.
type Egress struct {
	cfg Config
	log *slog.Logger

	mu        sync.Mutex
	started   bool
	closed    bool
	maps      *redirect.EgressMaps
	workloads map[uint64]WorkloadID // cgroup id -> workload, as written
	grants    *Grants
	reader    *ringbuf.Reader
	events    chan Event
	lost      atomic.Uint64
	stop      context.CancelFunc
	done      sync.WaitGroup
}

// New validates cfg. It touches nothing in the kernel.
func New(cfg Config) (*Egress, error) {
	if cfg.Datapath == nil {
		return nil, errors.New("egress: no datapath")
	}
	if cfg.Grace < 0 || cfg.Quota < 0 || cfg.Sweep < 0 || cfg.EventBuffer < 0 {
		return nil, fmt.Errorf("egress: negative grace %v, quota %d, sweep %v or event buffer %d",
			cfg.Grace, cfg.Quota, cfg.Sweep, cfg.EventBuffer)
	}
	if cfg.Grace == 0 {
		cfg.Grace = DefaultGrace
	}
	if cfg.Sweep == 0 {
		cfg.Sweep = DefaultSweep
	}
	if cfg.EventBuffer == 0 {
		cfg.EventBuffer = DefaultEventBuffer
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Egress{cfg: cfg, log: log, workloads: map[uint64]WorkloadID{}, events: make(chan Event, cfg.EventBuffer)}, nil
}

// Start takes the datapath's egress maps, adopts the grants and workloads a
// previous agent left in them, and starts the event reader and the sweeper.
// It does not switch enforcement on or off: a restarted agent keeps what the
// last one set until Enable.
func (e *Egress) Start(ctx context.Context) (err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.started || e.closed {
		return errors.New("egress: already started or closed")
	}
	e.started = true
	if err := ctx.Err(); err != nil {
		return err
	}
	m := e.cfg.Datapath.Egress()
	if m == nil {
		return errors.New("egress: the datapath is not started")
	}
	e.maps = m
	limit := int(m.Grants.MaxEntries())
	quota := e.cfg.Quota
	if quota == 0 {
		quota = max(limit/16, 1)
	}
	e.grants = newGrants(mapStore{m.Grants}, limit, quota, e.cfg.Grace, monotonicNow)
	adopted, expired, err := e.grants.adopt(m.Grants)
	if err != nil {
		return fmt.Errorf("egress: adopt pinned grants: %w", err)
	}
	if err := e.adoptWorkloads(); err != nil {
		return err
	}
	if e.reader, err = ringbuf.NewReader(m.Events); err != nil {
		return fmt.Errorf("egress: open the events ring buffer: %w", err)
	}
	sctx, cancel := context.WithCancel(context.Background())
	e.stop = cancel
	e.done.Add(2)
	go e.readEvents()
	go e.sweep(sctx)
	e.log.Info("egress datapath started", "grant_cap", limit, "quota", quota, "adopted_grants", adopted,
		"expired_grants_removed", expired, "workloads", len(e.workloads), "enabled", m.Enabled())
	return nil
}

func (e *Egress) adoptWorkloads() error {
	var (
		cg   uint64
		rule redirect.EgressRule
	)
	it := e.maps.Workloads.Iterate()
	for it.Next(&cg, &rule) {
		e.workloads[cg] = WorkloadID(rule.Workload)
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("egress: read pinned workloads: %w", err)
	}
	return nil
}

// Close stops the event reader and the sweeper. The maps, grants and
// workloads stay for the next agent. Idempotent.
func (e *Egress) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	rd, stop := e.reader, e.stop
	e.mu.Unlock()
	var err error
	if stop != nil {
		stop()
	}
	if rd != nil {
		err = rd.Close() // readEvents closes the channel
	} else {
		close(e.events) // never started
	}
	e.done.Wait()
	if err != nil {
		return fmt.Errorf("egress: close the events reader: %w", err)
	}
	return nil
}

// running returns the maps, or an error before Start or after Close.
func (e *Egress) running() (*redirect.EgressMaps, error) {
	if !e.started || e.closed || e.maps == nil {
		return nil, errors.New("egress: not running")
	}
	return e.maps, nil
}

// Grants is where the resolver writes grants (nil before Start).
func (e *Egress) Grants() *Grants {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.grants
}

// Enable switches enforcement on (the programs look up workloads) or off (one
// flag test and pass). It is kept across agent restarts.
func (e *Egress) Enable(on bool) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	m, err := e.running()
	if err != nil {
		return err
	}
	if err := m.SetEnabled(on); err != nil {
		return fmt.Errorf("egress: enable %v: %w", on, err)
	}
	return nil
}

// SetWorkload selects the cgroup cgroupID (and every cgroup below it) as
// workload id with rule r, or changes its rule.
func (e *Egress) SetWorkload(cgroupID uint64, id WorkloadID, r Rule) error {
	if cgroupID == 0 || id == 0 {
		return fmt.Errorf("egress: workload %d of cgroup %d: ids must be non-zero", id, cgroupID)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	m, err := e.running()
	if err != nil {
		return err
	}
	v := redirect.EgressRule{Workload: uint32(id), Flags: r.flags()}
	if err := m.Workloads.Put(&cgroupID, &v); err != nil {
		return fmt.Errorf("egress: write workload %d of cgroup %d: %w", id, cgroupID, err)
	}
	if old, ok := e.workloads[cgroupID]; ok && old != id {
		e.forgetLocked(old)
	}
	e.workloads[cgroupID] = id
	return nil
}

// Workloads returns the selected cgroups and their workloads: those set
// since Start and those a previous agent left in the pinned map (adopted by
// Start), for the caller to reconcile with what it selects now.
func (e *Egress) Workloads() map[uint64]WorkloadID {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make(map[uint64]WorkloadID, len(e.workloads))
	for cg, id := range e.workloads {
		out[cg] = id
	}
	return out
}

// RemoveWorkload unselects cgroupID. When no other cgroup has its workload
// id, that workload's grants and counters go too.
func (e *Egress) RemoveWorkload(cgroupID uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	m, err := e.running()
	if err != nil {
		return err
	}
	if err := m.Workloads.Delete(&cgroupID); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("egress: remove workload of cgroup %d: %w", cgroupID, err)
	}
	id, ok := e.workloads[cgroupID]
	delete(e.workloads, cgroupID)
	if ok {
		e.forgetLocked(id)
	}
	return nil
}

// forgetLocked removes id's grants and counters unless a cgroup still has it.
func (e *Egress) forgetLocked(id WorkloadID) {
	for _, other := range e.workloads {
		if other == id {
			return
		}
	}
	e.grants.removeWorkload(id)
	k := uint32(id)
	if err := e.maps.Stats.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		e.log.Warn("egress: remove a workload's counters", "workload", id, "err", err)
	}
}

// SetInternal replaces the internal prefixes (the cluster's Pod and Service
// CIDRs): destinations in them are allowed without a grant unless a rule puts
// them in scope.
func (e *Egress) SetInternal(prefixes []netip.Prefix) error {
	if len(prefixes) > redirect.EgressMaxInternal {
		return fmt.Errorf("egress: %d internal prefixes, at most %d", len(prefixes), redirect.EgressMaxInternal)
	}
	want := make(map[redirect.EgressLPMKey]bool, len(prefixes))
	for _, p := range prefixes {
		if !p.IsValid() {
			return fmt.Errorf("egress: internal prefix %v is not valid", p)
		}
		want[lpmKey(p)] = true
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	m, err := e.running()
	if err != nil {
		return err
	}
	one := uint32(1)
	for k := range want {
		if err := m.Internal.Put(&k, &one); err != nil {
			return fmt.Errorf("egress: write internal prefix: %w", err)
		}
	}
	var (
		k    redirect.EgressLPMKey
		v    uint32
		gone []redirect.EgressLPMKey
	)
	it := m.Internal.Iterate()
	for it.Next(&k, &v) {
		if !want[k] {
			gone = append(gone, k)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("egress: read internal prefixes: %w", err)
	}
	for _, k := range gone {
		if err := m.Internal.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("egress: remove internal prefix: %w", err)
		}
	}
	return nil
}

// lpmKey is p's egress_internal key: IPv4 as ::ffff:a.b.c.d/96+bits.
func lpmKey(p netip.Prefix) redirect.EgressLPMKey {
	p = p.Masked()
	bits := p.Bits()
	if p.Addr().Is4() {
		bits += 96
	}
	return redirect.EgressLPMKey{Prefixlen: uint32(bits), Addr: addrWords(p.Addr())}
}

// Counts are one workload's egress decisions, summed over CPUs.
type Counts struct {
	AllowedGrant    uint64 `json:"allowed_grant"`
	AllowedInternal uint64 `json:"allowed_internal"`
	Denied          uint64 `json:"denied"`
	Audited         uint64 `json:"audited"`
	FailOpen        uint64 `json:"fail_open"`      // allowed without a grant while no agent served (fail-open rule)
	EventsDropped   uint64 `json:"events_dropped"` // denied or audited events the ring buffer had no room for
}

// Counts returns the counters of every workload the programs counted for.
func (e *Egress) Counts() (map[WorkloadID]Counts, error) {
	e.mu.Lock()
	m, err := e.running()
	e.mu.Unlock()
	if err != nil {
		return nil, err
	}
	out := map[WorkloadID]Counts{}
	var (
		k    uint32
		vals []redirect.EgressCounters
	)
	it := m.Stats.Iterate()
	for it.Next(&k, &vals) {
		var c Counts
		for _, v := range vals {
			c.AllowedGrant += v.Counters[redirect.EgressAllowedGrant]
			c.AllowedInternal += v.Counters[redirect.EgressAllowedInternal]
			c.Denied += v.Counters[redirect.EgressDenied]
			c.Audited += v.Counters[redirect.EgressAudited]
			c.FailOpen += v.Counters[redirect.EgressFailOpen]
			c.EventsDropped += v.Counters[redirect.EgressEventDropped]
		}
		out[WorkloadID(k)] = c
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("egress: read counters: %w", err)
	}
	return out, nil
}

// sweep removes expired grants every Sweep until ctx ends.
func (e *Egress) sweep(ctx context.Context) {
	defer e.done.Done()
	t := time.NewTicker(e.cfg.Sweep)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if n, err := e.grants.Sweep(); err != nil {
				e.log.Warn("egress: remove expired grants", "removed", n, "err", err)
			}
		}
	}
}
