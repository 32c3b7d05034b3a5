package egressctl

import (
	"cmp"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
)

// DefaultTopWorkloads is how many workloads get series of their own; the
// rest are summed into workload="(other)".
const DefaultTopWorkloads = 50

// Other is the workload label of the workloads past the top.
const Other = "(other)"

// Counter reads the programs' per-workload decisions: (*egress.Egress)
// implements it.
type Counter interface {
	Counts() (map[egress.WorkloadID]egress.Counts, error)
	EventsLost() uint64
}

// Collector exports the egress decisions per workload, bounded to the top
// workloads by decisions as the top-talker series are, and the controller's
// own counts.
type Collector struct {
	c     *Controller
	count Counter
	top   int

	connects, selected, grants, syncErrs, eventsLost *prometheus.Desc
}

// NewCollector returns the collector of c's decisions (top: the workloads
// with series of their own; 0: DefaultTopWorkloads).
func NewCollector(c *Controller, count Counter, top int) *Collector {
	if top <= 0 {
		top = DefaultTopWorkloads
	}
	return &Collector{c: c, count: count, top: top,
		connects: prometheus.NewDesc("meshdns_egress_connects_total",
			"Connects and sends of policy-selected workloads, by verdict (granted, internal, denied, audited, fail_open) and workload (the top workloads; the rest are "+Other+").",
			[]string{"verdict", "workload", "client_namespace", "client_pod"}, nil),
		selected: prometheus.NewDesc("meshdns_egress_selected_workloads",
			"Workloads (pods' and units' cgroups) an egress policy selects on this node.", nil, nil),
		grants: prometheus.NewDesc("meshdns_egress_grants_total",
			"Answers to selected workloads, by result: granted (the name is allowed), not_allowed (no grant), error (the grant was not written).",
			[]string{"result"}, nil),
		syncErrs: prometheus.NewDesc("meshdns_egress_sync_errors_total",
			"Egress syncs that failed to write the datapath.", nil, nil),
		eventsLost: prometheus.NewDesc("meshdns_egress_events_lost_total",
			"Denied or audited connect events lost before the agent read them.", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (m *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.connects, m.selected, m.grants, m.syncErrs, m.eventsLost} {
		ch <- d
	}
}

type workloadCounts struct {
	name   string
	counts egress.Counts
}

func (w workloadCounts) total() uint64 {
	c := w.counts
	return c.AllowedGrant + c.AllowedInternal + c.Denied + c.Audited + c.FailOpen
}

// Collect implements prometheus.Collector.
func (m *Collector) Collect(ch chan<- prometheus.Metric) {
	sel := m.c.Selected()
	ch <- prometheus.MustNewConstMetric(m.selected, prometheus.GaugeValue, float64(len(sel)))
	for _, r := range []struct {
		result string
		n      int64
	}{{"granted", m.c.granted.Load()}, {"not_allowed", m.c.notAllowed.Load()}, {"error", m.c.grantErrs.Load()}} {
		ch <- prometheus.MustNewConstMetric(m.grants, prometheus.CounterValue, float64(r.n), r.result)
	}
	ch <- prometheus.MustNewConstMetric(m.syncErrs, prometheus.CounterValue, float64(m.c.Errors()))
	ch <- prometheus.MustNewConstMetric(m.eventsLost, prometheus.CounterValue, float64(m.count.EventsLost()))
	counts, err := m.count.Counts()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(m.connects, err)
		return
	}
	// Every selected workload has its series (at 0 before its first connect);
	// counters of a workload no longer selected, not yet removed, are (other).
	ws := make([]workloadCounts, 0, len(sel)+1)
	selected := map[egress.WorkloadID]bool{}
	for _, s := range sel {
		selected[s.ID] = true
		ws = append(ws, workloadCounts{s.Workload, counts[s.ID]})
	}
	for id, c := range counts {
		if !selected[id] {
			ws = append(ws, workloadCounts{Other, c})
		}
	}
	slices.SortFunc(ws, func(a, b workloadCounts) int {
		return cmp.Or(cmp.Compare(b.total(), a.total()), strings.Compare(a.name, b.name))
	})
	var other egress.Counts
	for i, w := range ws {
		if i >= m.top || w.name == Other {
			other = add(other, w.counts)
			continue
		}
		m.emit(ch, w.name, w.counts)
	}
	if other != (egress.Counts{}) {
		m.emit(ch, Other, other)
	}
}

func (m *Collector) emit(ch chan<- prometheus.Metric, workload string, c egress.Counts) {
	ns, pod := "", ""
	if a, b, ok := strings.Cut(workload, "/"); ok && !strings.HasPrefix(workload, "/") {
		ns, pod = a, b
	}
	for _, v := range []struct {
		verdict string
		n       uint64
	}{{"granted", c.AllowedGrant}, {"internal", c.AllowedInternal}, {"denied", c.Denied}, {"audited", c.Audited}, {"fail_open", c.FailOpen}} {
		ch <- prometheus.MustNewConstMetric(m.connects, prometheus.CounterValue, float64(v.n), v.verdict, workload, ns, pod)
	}
}

func add(a, b egress.Counts) egress.Counts {
	a.AllowedGrant += b.AllowedGrant
	a.AllowedInternal += b.AllowedInternal
	a.Denied += b.Denied
	a.Audited += b.Audited
	a.FailOpen += b.FailOpen
	a.EventsDropped += b.EventsDropped
	return a
}
