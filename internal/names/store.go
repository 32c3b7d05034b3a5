// Package names is the name store. It runs the name sources (the names
// file, the embedded demo table, the Kubernetes API server of this and of
// remote clusters, Istio ServiceEntries), merges what they contribute by
// source priority through a nametable.Builder, and publishes immutable
// table snapshots for the resolver. A burst of changes is coalesced over a
// short window into one snapshot, and a snapshot copies only what changed.
//
// The store is ready once every blocking source has delivered its first
// complete state; before that Table returns nil and the resolver is not
// ready. An optional source (Istio ServiceEntries) blocks readiness only
// while it works towards its first state: while it fails (its resources
// forbidden, its origin unreachable) the store is ready without it, and it
// comes in on its own when it recovers. A source that later fails (an
// unreachable API server) keeps its last state serving and reports the
// error in Status and metrics.
//
// Data flows one way: sources -> Sink -> Builder -> Table -> resolver.
package names

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// Source priorities (higher wins a name; see docs/kubernetes.md).
const (
	PriorityFile           = 100 // --names: the operator's own table
	PriorityIstiod         = 90  // --istiod: istiod's NDS, what the Istio agent would answer
	PriorityKubernetes     = 80  // this cluster
	PriorityRemoteCluster  = 60  // clusters of --remote-kubeconfigs / Istio remote secrets
	PriorityServiceEntries = 40  // Istio ServiceEntries (a Service of the same host wins)
	PriorityDemo           = 0   // the embedded demo table
)

// MaxAudits bounds the recomputations a source makes after audits that
// found a mismatch (Sink.Audit) before it syncs anyway: a mismatch that
// recomputing from the origin's state cannot fix is not a race, and must
// not keep the node's DNS from ever becoming ready.
const MaxAudits = 3

// DefaultWindow is the shortest time between two snapshots: a burst of
// changes within it is published as one.
const DefaultWindow = 5 * time.Millisecond

// Source feeds the store.
type Source interface {
	// Name identifies the source in status, metrics and the table
	// listing, e.g. "file", "kubernetes", "cluster/east".
	Name() string
	// Run delivers the source's state to sink until ctx ends. It calls
	// sink.Synced once its first complete state has been delivered. An
	// error it returns is reported and the source is not restarted; its
	// last state keeps serving.
	Run(ctx context.Context, sink Sink) error
}

// SourceOptions say how the store treats a source.
type SourceOptions struct {
	Priority int
	// NonBlocking sources never hold back readiness (remote clusters).
	NonBlocking bool
	// Optional sources hold back readiness only while they are not failing:
	// a failing optional source is degraded, not a reason to keep a node's
	// DNS unready. Its first complete state, when it comes after the store
	// is ready, is published in one snapshot.
	Optional bool
}

// SourceStatus is a source's state, for `status` and metrics.
type SourceStatus struct {
	Name       string    `json:"name"`
	Priority   int       `json:"priority"`
	Blocking   bool      `json:"blocking"`
	Optional   bool      `json:"optional,omitempty"`
	Synced     bool      `json:"synced"`
	Objects    int       `json:"objects"`
	Clients    int       `json:"clients"`
	LastUpdate time.Time `json:"lastUpdate,omitzero"`
	Errors     uint64    `json:"errors"`
	LastError  string    `json:"lastError,omitempty"`
	// AuditMismatches counts audits that found the store's objects of the
	// source differ from its origin's count (see Sink.Audit).
	AuditMismatches uint64 `json:"auditMismatches"`
	// FailingSince is when the source lost its origin; zero while healthy.
	FailingSince time.Time `json:"failingSince,omitzero"`
	// Detail is what a source that has more to say reports about itself
	// (see Detailer).
	Detail string `json:"detail,omitempty"`
}

// Detailer is a source with more to say in its status than the store
// knows (istiod's streams, say).
type Detailer interface {
	StatusDetail() string
}

// Config configures a Store.
type Config struct {
	Table nametable.Options
	// Window coalesces changes (default DefaultWindow).
	Window time.Duration
	// Clock measures the window (default the system's clock).
	Clock  Clock
	Logger *slog.Logger
	// Metrics, when set, receives the store's metrics (NewMetrics).
	Metrics *Metrics
	// LargeChange, when set, is told of changes that replace at least a
	// quarter of the table's hosts, such as a file whose every address
	// changed: LargeChange(true) before such a change is applied (when there
	// is a table to replace), LargeChange(false) once a table with it is
	// published (or it was dropped), and after a first load is published.
	// While such a change is applied, the old table and the new hosts live
	// side by side and almost everything allocated stays; once it is
	// published, the old table is garbage. The agent holds the collector
	// back meanwhile and collects once at the end (internal/agent/tune.go).
	// It must not block: it may be called with the store's lock held.
	LargeChange func(begins bool)
}

// Clock is the time the store's coalescing window is measured in.
type Clock interface {
	Now() time.Time
	// NewTimer starts a timer that fires once, after d.
	NewTimer(d time.Duration) Timer
}

// Timer is a Clock's timer.
type Timer interface {
	// C receives the time once the timer fires.
	C() <-chan time.Time
	// Stop stops the timer; it reports whether it had not fired yet.
	Stop() bool
}

// systemClock is the Clock of time.Now and time.Timer.
type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

func (systemClock) NewTimer(d time.Duration) Timer { return systemTimer{time.NewTimer(d)} }

type systemTimer struct{ t *time.Timer }

func (t systemTimer) C() <-chan time.Time { return t.t.C }

func (t systemTimer) Stop() bool { return t.t.Stop() }

// Store runs sources and publishes tables. Create with New, add sources,
// then Start; Close stops everything.
type Store struct {
	cfg Config
	log *slog.Logger

	mu       sync.Mutex // guards b, srcs, ready, applying, replaced, large and the source states
	b        *nametable.Builder
	srcs     map[string]*sourceState
	ready    bool
	applying int // changes being applied in steps: no publishing meanwhile
	replaced int // hosts set or removed by Apply and Load since the last publish
	large    int // large changes begun (Config.LargeChange) and not ended
	pubErr   error
	started  bool
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup

	// betweenSteps, when set (tests), runs between two steps of a change
	// applied in steps, without the lock.
	betweenSteps func()

	cur      atomic.Pointer[nametable.Table]
	kick     chan struct{}
	closed   chan struct{}
	closeOne sync.Once
}

type sourceState struct {
	src     Source
	opts    SourceOptions
	synced  bool
	clients int
	last    time.Time
	errors  uint64
	lastErr string
	failing time.Time
	audits  uint64 // audit mismatches
	cancel  context.CancelFunc
	done    chan struct{}
	removed bool
}

// New creates a store.
func New(cfg Config) (*Store, error) {
	if cfg.Window <= 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Clock == nil {
		cfg.Clock = systemClock{}
	}
	b, err := nametable.NewBuilder(cfg.Table)
	if err != nil {
		return nil, err
	}
	s := &Store{
		cfg:    cfg,
		log:    cfg.Logger,
		b:      b,
		srcs:   map[string]*sourceState{},
		kick:   make(chan struct{}, 1),
		closed: make(chan struct{}),
	}
	if cfg.Metrics != nil {
		cfg.Metrics.attach(s)
	}
	return s, nil
}

// Domain is the cluster domain the tables are built for ("cluster.local.").
func (s *Store) Domain() string { return s.b.Domain() }

// Add registers a source; after Start it starts at once. Names must be
// unique.
func (s *Store) Add(src Source, opts SourceOptions) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	name := src.Name()
	if name == "" {
		return errors.New("names: a source needs a name")
	}
	if st, ok := s.srcs[name]; ok && !st.removed {
		return fmt.Errorf("names: source %q added twice", name)
	}
	st := &sourceState{src: src, opts: opts}
	s.srcs[name] = st
	s.b.AddSource(name, opts.Priority)
	if s.started {
		s.run(st)
	}
	return nil
}

// Remove stops a source and removes everything it contributed.
func (s *Store) Remove(name string) {
	s.mu.Lock()
	st, ok := s.srcs[name]
	if !ok || st.removed {
		s.mu.Unlock()
		return
	}
	st.removed = true
	cancel, done := st.cancel, st.done
	s.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	s.mu.Lock()
	if cur := s.srcs[name]; cur == st {
		delete(s.srcs, name)
		s.b.RemoveSource(name)
	}
	s.mu.Unlock()
	s.poke()
}

// Start runs the sources and the publisher. ctx bounds nothing here (the
// sources start in the background); stop with Close.
func (s *Store) Start(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return errors.New("names: store already started")
	}
	s.started = true
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.publisher()
	for _, st := range s.srcs {
		s.run(st)
	}
	s.checkReadyLocked()
	return nil
}

// run starts a source's goroutine; s.mu is held.
func (s *Store) run(st *sourceState) {
	ctx, cancel := context.WithCancel(s.ctx)
	st.cancel, st.done = cancel, make(chan struct{})
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer close(st.done)
		err := st.src.Run(ctx, &sink{s: s, st: st, name: st.src.Name()})
		if err != nil && ctx.Err() == nil {
			s.log.Error("name source stopped", "source", st.src.Name(), "err", err)
			s.mu.Lock()
			st.errors++
			st.lastErr = err.Error()
			if st.failing.IsZero() {
				st.failing = time.Now()
			}
			s.checkReadyLocked() // an optional source that stopped is not waited for
			s.mu.Unlock()
		}
	}()
}

// Close stops the sources and the publisher. The last table stays
// readable.
func (s *Store) Close() error {
	s.closeOne.Do(func() {
		s.mu.Lock()
		cancel := s.cancel
		s.mu.Unlock()
		if cancel != nil {
			cancel()
		}
		close(s.closed)
		s.wg.Wait()
	})
	return nil
}

// Table returns the current snapshot, nil until the store is ready.
func (s *Store) Table() *nametable.Table { return s.cur.Load() }

// Ready returns nil once every blocking source has synced and the first
// table is published, else an error naming what is missing.
func (s *Store) Ready() error {
	if s.cur.Load() != nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var waiting []string
	for name, st := range s.srcs {
		if st.waitedFor() {
			w := name
			if st.lastErr != "" {
				w += " (" + st.lastErr + ")"
			}
			waiting = append(waiting, w)
		}
	}
	sort.Strings(waiting)
	if s.pubErr != nil && len(waiting) == 0 {
		return s.pubErr
	}
	if len(waiting) == 0 {
		return errors.New("first name table not published yet")
	}
	return fmt.Errorf("waiting for name sources to sync: %s", strings.Join(waiting, ", "))
}

// Status lists the sources by name.
func (s *Store) Status() []SourceStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]SourceStatus, 0, len(s.srcs))
	for name, st := range s.srcs {
		if st.removed {
			continue
		}
		out = append(out, SourceStatus{
			Name: name, Priority: st.opts.Priority, Blocking: !st.opts.NonBlocking, Optional: st.opts.Optional, Synced: st.synced,
			Objects: s.b.Objects(name), Clients: st.clients, LastUpdate: st.last, Errors: st.errors,
			LastError: st.lastErr, FailingSince: st.failing, AuditMismatches: st.audits,
		})
		if d, ok := st.src.(Detailer); ok {
			out[len(out)-1].Detail = d.StatusDetail()
		}
	}
	slices.SortFunc(out, func(a, b SourceStatus) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func (s *Store) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// waitedFor reports whether readiness waits for st: a blocking source
// that has not synced, unless it is optional and failing.
func (st *sourceState) waitedFor() bool {
	return !st.opts.NonBlocking && !st.synced && !st.removed && !(st.opts.Optional && !st.failing.IsZero())
}

// checkReadyLocked flips ready when no source is waited for.
func (s *Store) checkReadyLocked() {
	if s.ready {
		return
	}
	var degraded []string
	for name, st := range s.srcs {
		if st.waitedFor() {
			return
		}
		if st.opts.Optional && !st.synced && !st.removed {
			degraded = append(degraded, name+" ("+st.lastErr+")")
		}
	}
	s.ready = true
	if len(degraded) > 0 {
		sort.Strings(degraded)
		s.log.Warn("ready without optional name sources that fail; each comes in once it recovers", "sources", strings.Join(degraded, ", "))
	}
	s.poke()
}

// holdingLocked reports whether an optional source is delivering its first
// complete state after the store became ready: publishing waits for its
// Synced, so that state goes out in one snapshot (VIPs allocated in one
// batch, as at start). A source that fails meanwhile is not waited for.
func (s *Store) holdingLocked() bool {
	for _, st := range s.srcs {
		if st.opts.Optional && !st.synced && !st.removed && !st.last.IsZero() && st.failing.IsZero() {
			return true
		}
	}
	return false
}

// publisher publishes a change at once when the last publish is at least a
// window ago, and otherwise at the end of that window: an isolated update
// is answered within about a millisecond, and a burst costs one snapshot
// per window.
func (s *Store) publisher() {
	defer s.wg.Done()
	clock := s.cfg.Clock
	var timer Timer
	var fire <-chan time.Time // timer's, while it is armed
	var last time.Time
	for {
		select {
		case <-s.closed:
			if timer != nil {
				timer.Stop()
			}
			return
		case <-s.kick:
			if fire != nil {
				continue
			}
			if wait := s.cfg.Window - clock.Now().Sub(last); wait > 0 {
				timer = clock.NewTimer(wait)
				fire = timer.C()
				continue
			}
			last = clock.Now()
			s.publish()
		case <-fire:
			timer, fire = nil, nil
			last = clock.Now()
			s.publish()
		}
	}
}

func (s *Store) publish() {
	s.mu.Lock()
	if !s.ready || (!s.b.Changed() && s.cur.Load() != nil) || s.holdingLocked() || s.applying > 0 {
		s.mu.Unlock()
		return
	}
	start := time.Now()
	t, err := s.b.Publish()
	s.pubErr = err
	prev := 0 // hosts of the table before
	if cur := s.cur.Load(); cur != nil {
		prev = cur.Len()
	}
	ended := s.cfg.LargeChange != nil && (s.large > 0 || (s.replaced > 0 && 4*s.replaced >= prev))
	s.large, s.replaced = 0, 0
	s.mu.Unlock()
	if err != nil {
		s.log.Error("name table published with hosts left out", "err", err)
	}
	first := s.cur.Load() == nil
	s.cur.Store(t)
	d := time.Since(start)
	if m := s.cfg.Metrics; m != nil {
		m.published(t, d)
	}
	if first {
		s.log.Info("name table ready", "hosts", t.Len(), "build", d)
	} else {
		s.log.Debug("name table published", "hosts", t.Len(), "serial", t.Serial(), "build", d)
	}
	if ended {
		s.cfg.LargeChange(false)
	}
}
