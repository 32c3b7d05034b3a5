package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// captureMechanismCollector exports, per forward hook of the datapath, by which
// mechanism a query to a captured nameserver is captured beside other
// datapaths' programs (redirect.HookCaptures, at scrape time): 1 for the
// current one, 0 for the others.
type captureMechanismCollector struct {
	query func() ([]redirect.HookCapture, error)
	desc  *prometheus.Desc
}

func newCaptureMechanismCollector(query func() ([]redirect.HookCapture, error)) *captureMechanismCollector {
	return &captureMechanismCollector{query: query, desc: prometheus.NewDesc("meshdns_datapath_capture_mechanism",
		"How queries to the captured nameservers are captured on this forward hook: ordering (ours run first), backend-capture (another program runs first; the backends it translates to are captured) or none (another program runs first and its translations are not captured). 1 for the current mechanism.",
		[]string{"hook", "mechanism"}, nil)}
}

func (c *captureMechanismCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *captureMechanismCollector) Collect(ch chan<- prometheus.Metric) {
	hcs, err := c.query()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	for _, hc := range hcs {
		for _, m := range redirect.Mechanisms {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, b2f(hc.Mechanism == m), hc.Hook, m)
		}
	}
}
