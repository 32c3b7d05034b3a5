package names

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// Metrics are the store's Prometheus metrics. Per-source values are read
// from the store at scrape time.
type Metrics struct {
	hosts     prometheus.Gauge
	publishes prometheus.Counter
	duration  prometheus.Histogram
	lastPub   prometheus.Gauge
	store     *Store
}

var (
	descSynced = prometheus.NewDesc("meshdns_names_source_synced",
		"1 once the source delivered its first complete state.", []string{"source"}, nil)
	descObjects = prometheus.NewDesc("meshdns_names_source_objects",
		"Objects (Services, ServiceEntries, file entries) the source contributes hosts for.", []string{"source"}, nil)
	descClients = prometheus.NewDesc("meshdns_names_source_clients",
		"Clients (Pods of this node) whose namespace the source knows.", []string{"source"}, nil)
	descLast = prometheus.NewDesc("meshdns_names_source_last_update_timestamp_seconds",
		"Unix time of the source's last change.", []string{"source"}, nil)
	descErrors = prometheus.NewDesc("meshdns_names_source_errors_total",
		"Errors of the source: bad objects, failed loads, lost connections.", []string{"source"}, nil)
	descAudits = prometheus.NewDesc("meshdns_names_source_audit_mismatches_total",
		"Audits before a source's first sync that found the store's objects of the source differ from its origin (each is followed by a full recomputation).", []string{"source"}, nil)
	descStale = prometheus.NewDesc("meshdns_names_source_stale_seconds",
		"How long the source has been unable to reach its origin while its last state keeps serving (0: healthy).", []string{"source"}, nil)
)

// NewMetrics creates the store metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		hosts: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshdns_nametable_hosts", Help: "Hosts in the name table currently serving.",
		}),
		publishes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshdns_names_publishes_total", Help: "Name table snapshots published.",
		}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "meshdns_names_publish_duration_seconds",
			Help:    "Time to build and publish one name table snapshot.",
			Buckets: []float64{.0001, .0003, .001, .003, .01, .03, .1, .3, 1, 3},
		}),
		lastPub: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshdns_names_last_publish_timestamp_seconds", Help: "Unix time of the last published name table.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.hosts, m.publishes, m.duration, m.lastPub, m} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register name store metrics: %w", err)
			}
		}
	}
	return m, nil
}

func (m *Metrics) attach(s *Store) { m.store = s }

func (m *Metrics) published(t *nametable.Table, d time.Duration) {
	m.hosts.Set(float64(t.Len()))
	m.publishes.Inc()
	m.duration.Observe(d.Seconds())
	m.lastPub.SetToCurrentTime()
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSynced, descObjects, descClients, descLast, descErrors, descAudits, descStale} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	if m.store == nil {
		return
	}
	now := time.Now()
	for _, st := range m.store.Status() {
		b := 0.0
		if st.Synced {
			b = 1
		}
		ch <- prometheus.MustNewConstMetric(descSynced, prometheus.GaugeValue, b, st.Name)
		ch <- prometheus.MustNewConstMetric(descObjects, prometheus.GaugeValue, float64(st.Objects), st.Name)
		ch <- prometheus.MustNewConstMetric(descClients, prometheus.GaugeValue, float64(st.Clients), st.Name)
		last := 0.0
		if !st.LastUpdate.IsZero() {
			last = float64(st.LastUpdate.UnixNano()) / 1e9
		}
		ch <- prometheus.MustNewConstMetric(descLast, prometheus.GaugeValue, last, st.Name)
		ch <- prometheus.MustNewConstMetric(descErrors, prometheus.CounterValue, float64(st.Errors), st.Name)
		ch <- prometheus.MustNewConstMetric(descAudits, prometheus.CounterValue, float64(st.AuditMismatches), st.Name)
		stale := 0.0
		if !st.FailingSince.IsZero() {
			stale = now.Sub(st.FailingSince).Seconds()
		}
		ch <- prometheus.MustNewConstMetric(descStale, prometheus.GaugeValue, stale, st.Name)
	}
}
