package resolver

import (
	"fmt"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// The AAAA filter (Config.FilterAAAA), for IPv4-only clusters: an AAAA query that the
// table does not answer, and that would therefore be forwarded, is answered at once with
// NOERROR and no records (NODATA) with the cluster domain's SOA in the authority section,
// so that clients cache the denial for the table TTL. It is never NOTIMP or an error: a
// resolver library then simply has no IPv6 address. Table answers (and what follows a
// table CNAME or an autopath expansion) are kept, so only the forwarded part becomes
// NODATA. It is built as a forwarded answer and encoded as one: the client's ID, case,
// EDNS and size limit are handled by the same code.

// newFilterMetric registers the counter of filtered AAAA queries.
func newFilterMetric(reg prometheus.Registerer) (prometheus.Counter, error) {
	c := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "meshdns_dns_aaaa_filtered_total",
		Help: "AAAA queries of names the table does not answer, answered NODATA at once instead of forwarded (--filter-aaaa).",
	})
	if reg != nil {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register AAAA filter metric: %w", err)
		}
	}
	return c, nil
}

// filterAAAA answers r (about to be forwarded as an AAAA query of the name the table does
// not answer; cname is the external autopath CNAME target, or "") with NODATA when the
// filter is on. done is false when the query is to be forwarded as usual.
func (w *worker) filterAAAA(r *request, out []byte, cname string) (b []byte, done bool) {
	s := w.s
	if !s.filterAAAA || r.qtype != dns.TypeAAAA {
		return nil, false
	}
	t := s.tables.Table()
	if t == nil {
		return nil, false // no table yet: no SOA to give, and nothing is served from it either
	}
	soa := w.soaWire(t, t.DomainSOA())
	if soa == nil {
		return nil, false
	}
	a := upstream.Answer{Records: soa, Authority: 1, RecursionAvailable: true}
	kind := tap.Table
	if r.msg != nil {
		b = s.pack(s.answerMsg(r.msg, r.opt, r.limit, r.prefix, &a), out)
	} else {
		b = encodeWire(out, r.pkt[:r.qend], r.edns, r.do, r.limit, s.ttl, cname, &a)
		if b == nil {
			b = s.truncated(out, r.pkt[:r.qend], r.edns, r.do, r.limit, cname, &a)
		}
		if cname != "" {
			kind = tap.Autopath
		}
	}
	s.aaaaFiltered.Inc()
	return r.answered(b, dns.RcodeSuccess, srcTable, kind), true
}
