package kube

import (
	"context"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// negProbe is one question asked before an object exists (its negative answer) and
// after (the answer the object gives).
type negProbe struct {
	from, name string
	qtype      uint16
	before     string // the negative answer: NXDOMAIN, NODATA, or an autopath CNAME to a name without data
	after      string
	forwarded  string // the name the agent forwards before the object exists ("": answered by the table)
}

// eventStamps records when the test's own watch first saw each object.
type eventStamps struct {
	mu   sync.Mutex
	seen map[string]time.Time
}

// watchEvents stamps the first Added event of every object from w, keyed by key.
func watchEvents(t *testing.T, open func(ctx context.Context) (watch.Interface, error), key func(runtime.Object) string) *eventStamps {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w, err := open(ctx)
	if err != nil {
		t.Fatalf("watch: %v", err)
	}
	t.Cleanup(w.Stop)
	e := &eventStamps{seen: map[string]time.Time{}}
	go func() {
		for ev := range w.ResultChan() {
			if ev.Type != watch.Added && ev.Type != watch.Modified {
				continue
			}
			now := time.Now()
			k := key(ev.Object)
			e.mu.Lock()
			if _, ok := e.seen[k]; !ok && k != "" {
				e.seen[k] = now
			}
			e.mu.Unlock()
		}
	}()
	return e
}

func (e *eventStamps) wait(t *testing.T, k string) time.Time {
	t.Helper()
	var at time.Time
	testenv.Eventually(t, 10*time.Second, func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		at = e.seen[k]
		return !at.IsZero()
	}, "the test's watch never saw %s", k)
	return at
}

// A name first answered NXDOMAIN or NODATA (forwarded and negatively cached, answered
// by autopath for an external name, or by the table under the cluster domain) that a
// Service, a ServiceEntry or a pod's hostname record later creates is answered from the
// table within 100 ms of the watch event that carries the object: neither our negative
// cache nor autopath shadows it.
func TestNegativeAnswersFollowAPIServer(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	c.InstallServiceEntryCRD(t)
	for _, ns := range []string{"team-a", "team-b"} {
		c.EnsureNamespace(t, ns)
	}
	// A client of this node in team-a, on a loopback alias: its search path is known.
	const client = "127.0.0.2"
	c.CreatePod(t, kubetest.Pod{Namespace: "team-a", Name: "client", Node: node, IPs: []string{client}, Ready: true})
	// The headless Service whose pod (hostname db-0) comes later.
	c.CreateService(t, kubetest.Service{Namespace: "team-b", Name: "db", Headless: true})

	a := startAgent(t, c, node)
	a.waitReady(60 * time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool { return a.metric(`meshdns_names_source_clients{source="kubernetes"}`) == 1 },
		"clients known = %v, want the team-a pod", a.metric(`meshdns_names_source_clients{source="kubernetes"}`))
	// The upstream knows v6.late.example with an IPv4 address only: its AAAA is NODATA.
	a.up.Set("v6.late.example", netip.MustParseAddr("192.0.2.71"))

	services := watchEvents(t, func(ctx context.Context) (watch.Interface, error) {
		return c.AdminClient().CoreV1().Services("team-b").Watch(ctx, metav1.ListOptions{})
	}, func(o runtime.Object) string { m, _ := o.(metav1.Object); return nameOf(m) })
	entries := watchEvents(t, func(ctx context.Context) (watch.Interface, error) {
		return c.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace("team-b").Watch(ctx, metav1.ListOptions{})
	}, func(o runtime.Object) string { m, _ := o.(metav1.Object); return nameOf(m) })
	slices := watchEvents(t, func(ctx context.Context) (watch.Interface, error) {
		return c.AdminClient().DiscoveryV1().EndpointSlices("team-b").Watch(ctx, metav1.ListOptions{})
	}, func(o runtime.Object) string {
		// The first slice write that holds an endpoint: the pod's hostname record.
		es, ok := o.(*discoveryv1.EndpointSlice)
		if !ok || len(es.Endpoints) == 0 {
			return ""
		}
		return es.Labels[discoveryv1.LabelServiceName]
	})

	const d = ".svc.cluster.local."
	var lateIP string
	phases := []struct {
		what   string
		create func()
		event  func() time.Time
		probes func() []negProbe
	}{{
		what: "Service team-b/late",
		create: func() {
			lateIP = c.CreateService(t, kubetest.Service{Namespace: "team-b", Name: "late"}).Spec.ClusterIP
		},
		event: func() time.Time { return services.wait(t, "late") },
		probes: func() []negProbe {
			return []negProbe{
				{"", "late.team-b.", dns.TypeA, "NXDOMAIN", lateIP, "late.team-b."},
				{"", "late.team-b.", dns.TypeAAAA, "NXDOMAIN", "NODATA", "late.team-b."},
				// The client's first search expansion: autopath for an external name
				// (a CNAME to late.team-b. and its negatively cached NXDOMAIN), then
				// autopath to the Service.
				{client, "late.team-b.team-a" + d, dns.TypeA, "NXDOMAIN", lateIP + " CNAME:late.team-b" + d, "late.team-b."},
				{"", "late.team-b" + d, dns.TypeA, "NXDOMAIN", lateIP, ""},
			}
		},
	}, {
		what: "ServiceEntry team-b/late",
		create: func() {
			createSE(t, c, "team-b", "late", map[string]any{"hosts": strs("api.late.example", "v6.late.example"), "resolution": "STATIC",
				"addresses": strs("192.0.2.70", "2001:db8::70"), "endpoints": []any{map[string]any{"address": "192.0.2.72"}},
				"ports": []any{map[string]any{"number": int64(443), "name": "tls", "protocol": "TLS"}}})
		},
		event: func() time.Time { return entries.wait(t, "late") },
		probes: func() []negProbe {
			return []negProbe{
				{"", "api.late.example.", dns.TypeA, "NXDOMAIN", "192.0.2.70", "api.late.example."},
				{client, "api.late.example.team-a" + d, dns.TypeA, "NXDOMAIN", "192.0.2.70 CNAME:api.late.example.", "api.late.example."},
				// NODATA upstream (a name with IPv4 only), cached, then an IPv6
				// address from the ServiceEntry.
				{"", "v6.late.example.", dns.TypeAAAA, "NODATA", "2001:db8::70", "v6.late.example."},
				{client, "v6.late.example.team-a" + d, dns.TypeAAAA, "CNAME:v6.late.example.", "2001:db8::70 CNAME:v6.late.example.", "v6.late.example."},
			}
		},
	}, {
		what: "Pod team-b/db-0 (hostname db-0 of headless Service db)",
		create: func() {
			c.CreatePod(t, kubetest.Pod{Namespace: "team-b", Name: "db-0", Node: node, Labels: map[string]string{"app": "db"},
				IPs: []string{"10.244.5.5"}, Ready: true, Hostname: "db-0", Subdomain: "db"})
		},
		event: func() time.Time { return slices.wait(t, "db") },
		probes: func() []negProbe {
			return []negProbe{
				{"", "db-0.db.team-b" + d, dns.TypeA, "NXDOMAIN", "10.244.5.5", ""},
				{"", "db.team-b" + d, dns.TypeA, "NXDOMAIN", "10.244.5.5", ""}, // headless, no endpoint yet
			}
		},
	}}
	for _, ph := range phases {
		// Before: each name's negative answer, cached where it was forwarded (a second
		// ask does not reach the upstream).
		before := ph.probes()
		var cachedAt time.Time
		for _, p := range before {
			if got := a.ask(p.from, p.name, p.qtype); got != p.before {
				t.Fatalf("before %s: %s %s = %q, want %q", ph.what, p.name, dns.TypeToString[p.qtype], got, p.before)
			}
			if p.forwarded == "" {
				continue
			}
			n := a.up.Count(p.forwarded)
			if n == 0 {
				t.Fatalf("before %s: %s was not forwarded (%s)", ph.what, p.name, p.forwarded)
			}
			if cachedAt.IsZero() {
				cachedAt = time.Now()
			}
			if got := a.ask(p.from, p.name, p.qtype); got != p.before || a.up.Count(p.forwarded) != n {
				t.Fatalf("before %s: %s asked again = %q with %d upstream queries, want %q from the cache (%d)",
					ph.what, p.name, got, a.up.Count(p.forwarded), p.before, n)
			}
		}

		start := time.Now()
		ph.create()
		created := time.Since(start)
		probes := ph.probes() // now with what creation allocated
		answered := make([]time.Time, len(probes))
		last := make([]string, len(probes))
		left := len(probes)
		testenv.Poll(5*time.Second, time.Millisecond, func() bool {
			for i, p := range probes {
				if !answered[i].IsZero() {
					continue
				}
				if last[i] = a.ask(p.from, p.name, p.qtype); last[i] == p.after {
					answered[i] = time.Now()
					left--
				}
			}
			return left == 0
		})
		ev := ph.event()
		for i, p := range probes {
			if answered[i].IsZero() {
				t.Errorf("%s: %s %s = %q, want %q within 5 s of its creation", ph.what, p.name, dns.TypeToString[p.qtype], last[i], p.after)
				continue
			}
			lat := answered[i].Sub(ev)
			t.Logf("%s: %-45s %-4s %-8s -> %q: %v after the watch event (%v after the create call began, which took %v)",
				ph.what, p.name, dns.TypeToString[p.qtype], p.before, p.after, lat.Round(100*time.Microsecond),
				answered[i].Sub(start).Round(100*time.Microsecond), created.Round(100*time.Microsecond))
			if lat > 100*time.Millisecond {
				t.Errorf("%s: %s %s answered %v after the watch event, want <= 100ms", ph.what, p.name, dns.TypeToString[p.qtype], lat)
			}
		}
		// The negative entries were still fresh when the positive answers came: they
		// live 5 s (the fake upstream's SOA TTL).
		if !cachedAt.IsZero() {
			if age := time.Since(cachedAt); age > 4*time.Second {
				t.Errorf("%s: the negative answers were cached %v before the last check; the test proves nothing past their 5 s TTL", ph.what, age)
			}
		}
	}
}

func nameOf(m metav1.Object) string {
	if m == nil {
		return ""
	}
	return strings.Clone(m.GetName())
}
