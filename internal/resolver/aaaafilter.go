package resolver

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// The AAAA filter (Config.FilterAAAA), for IPv4-only clusters: an AAAA query that the
// table does not answer, and that would therefore be forwarded, is answered at once with
// NOERROR and no records (NODATA) with the cluster domain's SOA in the authority section,
// so that clients cache the denial for the table TTL. It is never NOTIMP or an error: a
// resolver library then simply has no IPv6 address. Table answers (and what follows a
// table CNAME or an autopath expansion) are kept, so only the forwarded part becomes
// NODATA. decide makes the decision (decision.filtered); the forward stage
// (worker.filtered) builds it as a forwarded answer and encodes it as one: the client's
// ID, case, EDNS and size limit are handled by the same code.

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
