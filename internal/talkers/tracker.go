package talkers

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Defaults of Config.
const (
	DefaultK              = 10
	DefaultWindow         = time.Minute
	DefaultPeriod         = 5 * time.Second
	DefaultNamespaceLimit = 50
)

// Label values no workload or namespace can have (Kubernetes names have no
// parentheses and cgroup paths start with "/").
const (
	Other     = "(other)"   // the workloads (or namespaces) past K (or the cap)
	NoPod     = "(none)"    // the namespace of a workload that is not a pod
	NoneKnown = "(unknown)" // the namespace of an unknown sender
)

// Config configures a Tracker.
type Config struct {
	K      int           // workloads per ranking (default 10)
	Window time.Duration // the sliding window (default 1m), a multiple of Period
	Period time.Duration // how often the window moves (default 5s)
	// Namespaces adds meshdns_namespace_{queries,nxdomain}_total, for at most
	// NamespaceLimit namespaces (default 50); the rest count as "(other)".
	Namespaces     bool
	NamespaceLimit int
	// Name names keys (workload.Namer.Name); Learn is told of keys new in a
	// period (workload.Namer.Learn; may be nil).
	Name  func(workload.Key) workload.Identity
	Learn func(workload.Key)
}

// Tracker keeps the window and exports it; see the package comment.
// Lifecycle: New validates, Start starts moving the window, Close stops it.
type Tracker struct {
	cfg     Config
	counter Counter
	tables  [2]*table
	prev    *table // out of use since the last move; read at the next

	mu      sync.Mutex
	periods []period // the window, oldest first
	top     ranking
	ns      map[string]*Counts // cumulative, at most NamespaceLimit + fixed names

	descs [6]*prometheus.Desc
	stop  context.CancelFunc
	done  chan struct{}
}

// period is one Period's counts.
type period struct {
	counts map[workload.Key]Counts
	other  Counts // what the table had no room for
}

// New validates cfg.
func New(cfg Config) (*Tracker, error) {
	if cfg.K == 0 {
		cfg.K = DefaultK
	}
	if cfg.Period == 0 {
		cfg.Period = DefaultPeriod
	}
	if cfg.Window == 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.NamespaceLimit == 0 {
		cfg.NamespaceLimit = DefaultNamespaceLimit
	}
	switch {
	case cfg.K < 1 || cfg.K > 1000:
		return nil, fmt.Errorf("top-K %d: want 1 to 1000", cfg.K)
	case cfg.Period <= 0 || cfg.Window < cfg.Period || cfg.Window%cfg.Period != 0:
		return nil, fmt.Errorf("window %s: want a positive multiple of %s", cfg.Window, cfg.Period)
	case cfg.Window/cfg.Period > 10000:
		return nil, fmt.Errorf("window %s: at most 10000 periods of %s", cfg.Window, cfg.Period)
	case cfg.NamespaceLimit < 1:
		return nil, fmt.Errorf("namespace limit %d: want at least 1", cfg.NamespaceLimit)
	case cfg.Name == nil:
		return nil, errors.New("talkers: no Name function")
	}
	t := &Tracker{cfg: cfg, tables: [2]*table{new(table), new(table)}, ns: map[string]*Counts{}}
	t.counter.cur.Store(t.tables[0])
	t.counter.learn = cfg.Learn
	t.prev = t.tables[1]
	// client_*, not namespace and pod: those are the target labels every
	// Kubernetes scrape (a ServiceMonitor, the kubernetes-pods job) sets to the
	// agent's own pod, and Prometheus would rename ours to exported_*.
	labels := []string{"workload", "client_namespace", "client_pod"}
	win := fmt.Sprintf(" in the last %s (the top %d workloads by this count; workload=%q: all others).", cfg.Window, cfg.K, Other)
	t.descs = [6]*prometheus.Desc{
		prometheus.NewDesc("meshdns_top_workload_queries", "Queries answered"+win, labels, nil),
		prometheus.NewDesc("meshdns_top_workload_nxdomain", "NXDOMAIN answers"+win, labels, nil),
		prometheus.NewDesc("meshdns_top_workload_unanswered", "Queries that got no answer in time (upstream timeout or failure, shed load)"+win, labels, nil),
		prometheus.NewDesc("meshdns_top_workload_window_seconds", "The sliding window of the meshdns_top_workload_* gauges.", nil, nil),
		prometheus.NewDesc("meshdns_namespace_queries_total", fmt.Sprintf("Queries answered, by the sender's namespace (%q: not a pod, %q: unknown, %q: past the cap).", NoPod, NoneKnown, Other), []string{"client_namespace"}, nil),
		prometheus.NewDesc("meshdns_namespace_nxdomain_total", "NXDOMAIN answers, by the sender's namespace.", []string{"client_namespace"}, nil),
	}
	return t, nil
}

// Counter is what the query path counts into.
func (t *Tracker) Counter() *Counter { return &t.counter }

// Start moves the window every Period until Close.
func (t *Tracker) Start(ctx context.Context) error {
	c, cancel := context.WithCancel(context.Background())
	t.stop, t.done = cancel, make(chan struct{})
	go func() {
		defer close(t.done)
		tick := time.NewTicker(t.cfg.Period)
		defer tick.Stop()
		for {
			select {
			case <-c.Done():
				return
			case <-tick.C:
				t.Move()
			}
		}
	}()
	return nil
}

// Close stops moving the window. Idempotent.
func (t *Tracker) Close() error {
	if t.stop != nil {
		t.stop()
		<-t.done
		t.stop = nil
	}
	return nil
}

// Move ends the current period: the table out of use since the last move is
// read into the window, emptied and put in use. (Start calls it every Period;
// tests may call it.)
func (t *Tracker) Move() {
	p := period{counts: map[workload.Key]Counts{}}
	t.prev.harvest(p.counts, &p.other)
	in := t.counter.cur.Swap(t.prev)
	t.prev = in
	names := map[workload.Key]workload.Identity{}
	for k := range p.counts {
		names[k] = t.cfg.Name(k)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.periods = append(t.periods, p)
	if n := int(t.cfg.Window / t.cfg.Period); len(t.periods) > n {
		t.periods = slices.Delete(t.periods, 0, len(t.periods)-n)
	}
	if t.cfg.Namespaces {
		t.countNamespaces(p, names)
	}
	t.top = t.rank(names)
}

// namespaceOf is the namespace label of a sender.
func namespaceOf(id workload.Identity) string {
	switch {
	case id.Namespace != "":
		return id.Namespace
	case id.Workload == workload.Unknown:
		return NoneKnown
	}
	return NoPod
}

func (t *Tracker) countNamespaces(p period, names map[workload.Key]workload.Identity) {
	add := func(ns string, c Counts) {
		n := t.ns[ns]
		if n == nil {
			if ns != NoPod && ns != NoneKnown && ns != Other && len(t.ns) >= t.cfg.NamespaceLimit {
				ns = Other
			}
			if n = t.ns[ns]; n == nil {
				n = new(Counts)
				t.ns[ns] = n
			}
		}
		n.add(c)
	}
	for k, c := range p.counts {
		add(namespaceOf(names[k]), c)
	}
	if p.other.Queries > 0 {
		add(Other, p.other)
	}
}

// entry is one workload's counts over the window, with its labels.
type entry struct {
	workload, namespace, pod string
	Counts
}

// ranking is the top K of each count and the rest.
type ranking struct {
	byQueries, byNX, byUnanswered []entry
	other                         [3]uint64
	seconds                       float64
}

// rank sums the window per workload (names of keys not in this period's
// names are looked up) and keeps the top K of each count.
func (t *Tracker) rank(names map[workload.Key]workload.Identity) ranking {
	per := map[string]*entry{}
	var total, other Counts
	for _, p := range t.periods {
		other.add(p.other)
		for k, c := range p.counts {
			id, ok := names[k]
			if !ok {
				id = t.cfg.Name(k)
				names[k] = id
			}
			e := per[id.Workload]
			if e == nil {
				e = &entry{workload: id.Workload, namespace: id.Namespace, pod: id.Pod}
				per[id.Workload] = e
			}
			e.add(c)
		}
	}
	all := make([]entry, 0, len(per))
	for _, e := range per {
		all = append(all, *e)
		total.add(e.Counts)
	}
	total.add(other)
	r := ranking{seconds: float64(len(t.periods)) * t.cfg.Period.Seconds()}
	top := func(get func(*Counts) uint64, tot uint64) ([]entry, uint64) {
		slices.SortFunc(all, func(a, b entry) int {
			if c := cmp.Compare(get(&b.Counts), get(&a.Counts)); c != 0 {
				return c
			}
			return cmp.Compare(a.workload, b.workload)
		})
		var out []entry
		var sum uint64
		for i := 0; i < len(all) && len(out) < t.cfg.K && get(&all[i].Counts) > 0; i++ {
			out = append(out, all[i])
			sum += get(&all[i].Counts)
		}
		return out, tot - sum
	}
	r.byQueries, r.other[0] = top(func(c *Counts) uint64 { return c.Queries }, total.Queries)
	r.byNX, r.other[1] = top(func(c *Counts) uint64 { return c.NXDomain }, total.NXDomain)
	r.byUnanswered, r.other[2] = top(func(c *Counts) uint64 { return c.Unanswered }, total.Unanswered)
	return r
}

// Describe implements prometheus.Collector.
func (t *Tracker) Describe(ch chan<- *prometheus.Desc) {
	for i, d := range t.descs {
		if i >= 4 && !t.cfg.Namespaces {
			break
		}
		ch <- d
	}
}

// Collect implements prometheus.Collector: the ranking of the last move.
func (t *Tracker) Collect(ch chan<- prometheus.Metric) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, list := range [][]entry{t.top.byQueries, t.top.byNX, t.top.byUnanswered} {
		get := [3]func(*Counts) uint64{
			func(c *Counts) uint64 { return c.Queries },
			func(c *Counts) uint64 { return c.NXDomain },
			func(c *Counts) uint64 { return c.Unanswered },
		}[i]
		for _, e := range list {
			ch <- prometheus.MustNewConstMetric(t.descs[i], prometheus.GaugeValue, float64(get(&e.Counts)), e.workload, e.namespace, e.pod)
		}
		ch <- prometheus.MustNewConstMetric(t.descs[i], prometheus.GaugeValue, float64(t.top.other[i]), Other, "", "")
	}
	ch <- prometheus.MustNewConstMetric(t.descs[3], prometheus.GaugeValue, t.top.seconds)
	if !t.cfg.Namespaces {
		return
	}
	for ns, c := range t.ns {
		ch <- prometheus.MustNewConstMetric(t.descs[4], prometheus.CounterValue, float64(c.Queries), ns)
		ch <- prometheus.MustNewConstMetric(t.descs[5], prometheus.CounterValue, float64(c.NXDomain), ns)
	}
}
