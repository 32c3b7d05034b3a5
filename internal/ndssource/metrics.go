package ndssource

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the NDS source's Prometheus metrics, per view (the
// namespace whose proxy the view is). The store's per-source metrics
// (meshdns_names_source_*{source="istiod"}) cover sync, errors and
// staleness.
type Metrics struct {
	pushes      *prometheus.CounterVec
	names       *prometheus.GaugeVec
	connected   *prometheus.GaugeVec
	disconnects *prometheus.CounterVec
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshdns_istiod_pushes_total", Help: "Name tables istiod pushed, per view.",
		}, []string{"view"}),
		names: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "meshdns_istiod_names", Help: "Names in the last name table istiod pushed, per view.",
		}, []string{"view"}),
		connected: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "meshdns_istiod_connected", Help: "1 while the view's stream to istiod delivers, 0 while it reconnects.",
		}, []string{"view"}),
		disconnects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshdns_istiod_stream_failures_total", Help: "Streams to istiod that ended or could not be opened, per view.",
		}, []string{"view"}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.pushes, m.names, m.connected, m.disconnects} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register istiod source metrics: %w", err)
			}
		}
	}
	return m, nil
}

func (m *Metrics) pushed(view string, names int) {
	if m == nil {
		return
	}
	m.pushes.WithLabelValues(view).Inc()
	m.names.WithLabelValues(view).Set(float64(names))
	m.connected.WithLabelValues(view).Set(1)
}

func (m *Metrics) disconnected(view string) {
	if m == nil {
		return
	}
	m.disconnects.WithLabelValues(view).Inc()
	m.connected.WithLabelValues(view).Set(0)
}

// dropped forgets the gauges of a view that is gone (no Pod of its
// namespace left on the node).
func (m *Metrics) dropped(view string) {
	if m == nil {
		return
	}
	m.names.DeleteLabelValues(view)
	m.connected.DeleteLabelValues(view)
}
