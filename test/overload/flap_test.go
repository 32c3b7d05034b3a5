package overload

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
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
	server := netip.MustParseAddrPort(a.dnsAddr)
	search := []string{".default.svc.cluster.local.", ".svc.cluster.local.", ".cluster.local.", "."}
	stop := make(chan struct{})
	noisy := make(chan *dnsfake.Paced, 1)
	go func() {
		p, err := dnsfake.PacedUDP(server, netip.MustParseAddr("127.0.0.1"), 20000, func(i int) string {
			return fmt.Sprintf("n%d-%d.nx.test%s", i/len(search), rand.Uint32(), search[i%len(search)])
		}, stop)
		if err != nil {
			t.Error(err)
		}
		noisy <- p
	}()
	quietNames := []string{meshName, "ext1.example.org.", meshName, "ext2.example.org.", meshName, "ext3.example.org."}
	quiet := make(chan *dnsfake.Probe, 1)
	go func() {
		p, err := dnsfake.MixProber(a.dnsAddr, netip.MustParseAddr("127.0.0.2"), quietNames, 5*time.Second, 5*time.Millisecond, stop)
		if err != nil {
			t.Error(err)
		}
		quiet <- p
	}()
	for end := time.Now().Add(d); time.Now().Before(end) && !a.proc.Exited(); {
		time.Sleep(time.Second) // the load's pace: check once a second that the agent still runs
	}
	close(stop)
	n, q := <-noisy, <-quiet
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

// metricValue reads one series (name and labels, exactly as /metrics prints them).
func metricValue(t *testing.T, a *agent, series string) float64 {
	t.Helper()
	name, _, _ := strings.Cut(series, "{")
	b, err := a.metricsText()
	if err != nil {
		t.Fatalf("scrape /metrics: %v", err)
	}
	for _, line := range strings.Split(b, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	t.Fatalf("/metrics has no series %s (metric %s)", series, name)
	return 0
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
