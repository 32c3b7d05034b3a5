package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// newStateMetrics exports what the alerts watch of the agent itself, read at
// scrape time: whether it is ready (/readyz) and whether capture is on.
func (a *Agent) newStateMetrics(mode string) []prometheus.Collector {
	ready := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "meshdns_ready",
		Help: "1 while the agent is ready (/readyz answers 200), 0 while not: capture is off and queries go to their original nameserver.",
	}, func() float64 { return b2f(a.Ready() == nil) })
	capture := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "meshdns_capture_active",
		Help:        "1 while capture sends queries to this agent (eBPF: the resolver's sockets are registered with the datapath; iptables: the rules are installed), 0 while queries bypass it; always 0 with --mode off.",
		ConstLabels: prometheus.Labels{"mode": mode},
	}, func() float64 { return b2f(a.capturing()) })
	return []prometheus.Collector{ready, capture}
}

// capturing reports whether capture currently sends queries to us.
func (a *Agent) capturing() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closing || a.handedOff {
		return false
	}
	switch {
	case a.dp != nil:
		return a.serving
	case a.rules != nil:
		return true
	}
	return false
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// foreignProgramsCollector exports how many other BPF programs run on each of the
// datapath's hooks for the capture cgroup, before and after ours (BPF_PROG_QUERY at
// scrape time: a handful of syscalls).
type foreignProgramsCollector struct {
	query func() ([]redirect.CgroupProgram, error)
	desc  *prometheus.Desc
}

func newForeignProgramsCollector(query func() ([]redirect.CgroupProgram, error)) *foreignProgramsCollector {
	return &foreignProgramsCollector{query: query, desc: prometheus.NewDesc("meshdns_datapath_foreign_programs",
		"Other BPF programs that run for sockets of the capture cgroup on this hook, before ours (they see, and may rewrite, the destination first) or after.",
		[]string{"hook", "order"}, nil)}
}

func (c *foreignProgramsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *foreignProgramsCollector) Collect(ch chan<- prometheus.Metric) {
	progs, err := c.query()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	for hook, f := range redirect.ForeignPrograms(progs) {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(f.Before), hook, "before")
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(f.After), hook, "after")
	}
}
