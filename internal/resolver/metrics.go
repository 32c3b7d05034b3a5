package resolver

import (
	"github.com/prometheus/client_golang/prometheus"
)

type proto uint8

const (
	protoUDP proto = iota
	protoTCP
	nProtos
)

var protoNames = [nProtos]string{"udp", "tcp"}

type source uint8

const (
	srcTable source = iota
	srcCache
	srcUpstream
	srcStale
	srcError
	srcAutopath // a search-path expansion answered from the table in one round trip
	nSources
)

var sourceNames = [nSources]string{"table", "cache", "upstream", "stale", "error", "autopath"}

// metrics holds pre-created label children so the query path does no label
// lookups: one per transport and qtype class, per rcode class and source (the
// classes an outcome is counted in: finish.go).
type metrics struct {
	requests  [nProtos][nQtypes]prometheus.Counter
	responses [nRcodes][nSources]prometheus.Counter
	duration  [nSources]prometheus.Observer
	dropped   prometheus.Counter
	overload  [3]prometheus.Counter // total, client, workload

	tcpEvicted, tcpRefused prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	req := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_dns_requests_total",
		Help: "DNS requests received, by transport and query type.",
	}, []string{"proto", "qtype"})
	resp := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_dns_responses_total",
		Help: "DNS responses sent, by rcode and where the answer came from.",
	}, []string{"rcode", "source"})
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "meshdns_dns_request_duration_seconds",
		Help:    "Time from receiving a request to having its response, by answer source.",
		Buckets: []float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5},
	}, []string{"source"})
	dropped := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshdns_dns_dropped_total",
		Help: "Packets not answered: shorter than a DNS header, or FORMERR responses sent to us (answering would loop).",
	})
	over := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_dns_overload_total",
		Help: "Queries answered at once instead of going upstream: too many pending in total (SERVFAIL) or from this client (REFUSED), or over the sending workload's budget (REFUSED).",
	}, []string{"limit"})
	tcpClosed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "meshdns_dns_tcp_connections_limited_total",
		Help: "TCP connections closed at the connection bound: the longest idle one for a new one (evicted), or the new one when none was idle (refused).",
	}, []string{"action"})
	if reg != nil {
		for _, c := range []prometheus.Collector{req, resp, dur, dropped, over, tcpClosed} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	m := &metrics{dropped: dropped, overload: [3]prometheus.Counter{over.WithLabelValues("total"), over.WithLabelValues("client"), over.WithLabelValues("workload")},
		tcpEvicted: tcpClosed.WithLabelValues("evicted"), tcpRefused: tcpClosed.WithLabelValues("refused")}
	for p := range nProtos {
		for q := range nQtypes {
			m.requests[p][q] = req.WithLabelValues(protoNames[p], qtypeLabels[q])
		}
	}
	for r := range nRcodes {
		for s := range nSources {
			m.responses[r][s] = resp.WithLabelValues(rcodeLabels[r], sourceNames[s])
		}
	}
	for s := range nSources {
		m.duration[s] = dur.WithLabelValues(sourceNames[s])
	}
	return m, nil
}
