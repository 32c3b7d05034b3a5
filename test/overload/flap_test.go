package overload

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// envDuration is the Go duration in the environment variable name, or def when it is
// unset: how long a load runs (`make soak` sets them to its SOAK).
func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("%s=%q: %v", name, v, err)
	}
	return d
}

// TestNoisyWorkloadBehindARateLimitingUpstream: an upstream that answers 2,000
// queries a second after 2 ms and drops the rest, one workload sending 20,000 qps of
// search-path expansions of names that do not exist (ndots:5 with the Kubernetes
// search list), the agent with its defaults, and a quiet workload asking table and
// external names at 200 qps. The upstream is alive all along: it must stay in
// rotation (no health transitions), no panic may happen, the agent stays up, and the
// quiet workload gets every answer.
//
// OVERLOAD_AGENT=<older binary> runs the same load against another build; what it
// counts from the log (a build before the transitions metric) is printed the same way.
func TestNoisyWorkloadBehindARateLimitingUpstream(t *testing.T) {
	d := envDuration(t, "MESHDNS_FLAP_SOAK", 10*time.Second)
	a := startAgentWith(t, dnsfake.RateLimited(nxOrAnswers, 2000, 2*time.Millisecond), "--log-level", "info")
	search := []string{".default.svc.cluster.local.", ".svc.cluster.local.", ".cluster.local.", "."}
	l := startLoad(t, a, func(i int) string {
		return fmt.Sprintf("n%d-%d.nx.test%s", i/len(search), rand.Uint32(), search[i%len(search)])
	})
	for end := time.Now().Add(d); time.Now().Before(end) && !a.proc.Exited(); {
		time.Sleep(time.Second) // the load's pace: check once a second that the agent still runs
	}
	n, q := l.stop()
	alive := !a.proc.Exited()
	log := a.proc.Log.String()
	m, _ := a.metrics("meshdns_upstream_health_transitions_total", "meshdns_panics_total")
	loggedDown, loggedUp := strings.Count(log, "upstream unhealthy"), strings.Count(log, "upstream healthy again")
	t.Logf("%s of load: noisy sent %d, answers %v; quiet: %d answered, %d failed, %d lost, p50 %s p99 %s; agent alive %v; "+
		"health transitions logged: %d down, %d up; metrics: %s",
		d, n.Sent, n.Answers, len(q.Latencies), q.Failed, q.Lost, q.Percentile(0.5).Round(time.Microsecond),
		q.Percentile(0.99).Round(time.Microsecond), alive, loggedDown, loggedUp, m)
	if !alive {
		t.Fatalf("the agent died under the load:\n%s", tail(log, 40))
	}
	if strings.Contains(log, "panic") {
		t.Errorf("the agent logged a panic:\n%s", tail(log, 40))
	}
	if v := metricValue(t, a, `meshdns_upstream_health_transitions_total{upstream="`+a.up.Addr.String()+`"}`); v != 0 {
		t.Errorf("the rate-limiting upstream changed health %v times: an upstream that answers its quota was taken out of rotation", v)
	}
	for _, stage := range []string{"serve", "answer", "upstream", "attribution"} {
		if v := metricValue(t, a, `meshdns_panics_total{stage="`+stage+`"}`); v != 0 {
			t.Errorf("meshdns_panics_total{stage=%q} = %v", stage, v)
		}
	}
	// Every quiet query is answered: none SERVFAIL or REFUSED. A datagram the kernel
	// drops on a CPU-starved machine (the listening sockets' buffers full of the noisy
	// workload's queries) is tolerated up to one in a thousand, and reported.
	if q.Failed > 0 || q.Lost*1000 > len(q.Latencies) || len(q.Latencies) == 0 {
		t.Errorf("quiet workload: %d answered, %d SERVFAIL/REFUSED, %d lost: want every query answered", len(q.Latencies), q.Failed, q.Lost)
	}
}

// metricValue reads one series (name and labels, exactly as /metrics prints them);
// a series /metrics does not have fails the test.
func metricValue(t *testing.T, a *agent, series string) float64 {
	t.Helper()
	v, ok := a.seriesValue(t, series)
	if !ok {
		name, _, _ := strings.Cut(series, "{")
		t.Fatalf("/metrics has no series %s (metric %s)", series, name)
	}
	return v
}

// seriesValue reads one series (name and labels, exactly as /metrics prints them);
// ok is false when /metrics does not have it.
func (a *agent) seriesValue(t *testing.T, series string) (v float64, ok bool) {
	t.Helper()
	b, err := a.metricsText()
	if err != nil {
		t.Fatalf("scrape /metrics: %v", err)
	}
	for _, line := range strings.Split(b, "\n") {
		if s, found := strings.CutPrefix(line, series+" "); found {
			f, err := strconv.ParseFloat(s, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f, true
		}
	}
	return 0, false
}

func tail(s string, lines int) string {
	l := strings.Split(s, "\n")
	return strings.Join(l[max(0, len(l)-lines):], "\n")
}

// nxOrAnswers answers NXDOMAIN (with an SOA) for names under nx.test, and as
// upstreamAnswers otherwise.
func nxOrAnswers(proto string, req *dns.Msg) []*dns.Msg {
	if !strings.Contains(strings.ToLower(req.Question[0].Name), ".nx.test.") {
		return upstreamAnswers(proto, req)
	}
	m := new(dns.Msg)
	m.SetRcode(req, dns.RcodeNameError)
	m.Ns = []dns.RR{dnsfake.SOA("nx.test.", 60)}
	return []*dns.Msg{m}
}
