package resolver

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// dropFirst answers every name NXDOMAIN (with an SOA), but drops the first query of
// each name: the resolution's first attempt times out and its retry is answered.
func dropFirst() dnsfake.Respond {
	var mu sync.Mutex
	seen := map[string]bool{}
	return func(_ string, r *dns.Msg) []*dns.Msg {
		name := strings.ToLower(r.Question[0].Name)
		mu.Lock()
		first := !seen[name]
		seen[name] = true
		mu.Unlock()
		if first {
			return nil
		}
		m := new(dns.Msg)
		m.SetReply(r)
		m.Rcode = dns.RcodeNameError
		m.Ns = []dns.RR{&dns.SOA{Hdr: dns.RR_Header{Name: ".", Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 300},
			Ns: "a.root.", Mbox: "h.root.", Serial: 1, Refresh: 2, Retry: 3, Expire: 4, Minttl: 300}}
		return []*dns.Msg{m}
	}
}

// A retry of an upstream attempt that timed out is an upstream query like the
// first: it takes a token of the workload's budget, and when the bucket is empty
// it is not sent and the query is answered as on a last timeout (SERVFAIL). So
// the upstream sees no more of a workload's queries than its budget, however
// many of them it drops.
func TestRetriesTakeFromTheWorkloadBudget(t *testing.T) {
	up, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: dropFirst()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(up.Close)
	freg := prometheus.NewRegistry()
	fwd := newForwarder(t, up.Addr.String(), freg, func(fcfg *upstream.Config) { fcfg.AttemptTimeout = 100 * time.Millisecond })
	const burst = 3
	ts := startServer(t, testFile(), func(c *Config) {
		c.Forwarder = fwd
		c.WorkloadBudget = BudgetLimits{QPS: 0.001, Burst: burst} // no refill within the test
	})
	names := []string{"r1.example.net.", "r2.example.net.", "r3.example.net."}
	var got []int
	for _, n := range names {
		rc := lockstep(t, ts.addr, "127.0.4.31", []string{n})
		for code := range rc {
			got = append(got, code)
		}
	}
	want := []int{dns.RcodeNameError, dns.RcodeServerFailure, dns.RcodeRefused}
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			t.Fatalf("rcodes %v, want %v: the first miss and its retry take 2 of the %d tokens, the second miss the last, "+
				"its retry finds none (SERVFAIL), the third miss none (REFUSED)", rcodeNames(got), rcodeNames(want), burst)
		}
	}
	if n := up.Count(); n != burst {
		t.Errorf("the upstream saw %d queries from a workload with a budget of %d", n, burst)
	}
	if v := metrictest.Value(t, freg, "meshdns_upstream_retries_over_budget_total"); v != 1 {
		t.Errorf("meshdns_upstream_retries_over_budget_total = %v, want 1", v)
	}
}

func rcodeNames(codes []int) []string {
	var out []string
	for _, c := range codes {
		out = append(out, dns.RcodeToString[c])
	}
	return out
}
