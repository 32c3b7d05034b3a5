package kube

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

const node = "node-a"

func requireRoot(t *testing.T) {
	t.Helper()
	// The agent itself needs no privilege in --mode off, but the control
	// plane's binaries come from make kube-bin and the tests bind loopback
	// aliases; run with the rest of the privileged suite.
	testenv.RequirePrivileged(t)
}

func reverse(ip string) string {
	r, _ := dns.ReverseAddr(ip)
	return r
}

// Every record kind of the Kubernetes DNS specification, from real API
// objects and controller-made EndpointSlices.
func TestRecords(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	web := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web", DualStack: true,
		Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}, {Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP}}})
	api := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "api"})
	c.CreateService(t, kubetest.Service{Namespace: "default", Name: "db", Headless: true,
		Ports: []corev1.ServicePort{{Name: "sql", Port: 5432, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(5432)}}})
	c.CreateService(t, kubetest.Service{Namespace: "default", Name: "all", Headless: true, PublishNotReadyAddresses: true, Selector: map[string]string{"app": "db"}})
	c.CreateService(t, kubetest.Service{Namespace: "default", Name: "ext", ExternalName: "ext.example.org"})
	for i, p := range []struct {
		ip       string
		ready    bool
		hostname string
	}{{"10.244.1.5", true, "db-0"}, {"10.244.1.6", false, "db-1"}, {"10.244.2.7", true, ""}} {
		c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: fmt.Sprintf("db-%d", i), Node: node,
			Labels: map[string]string{"app": "db"}, IPs: []string{p.ip}, Ready: p.ready, Hostname: p.hostname, Subdomain: "db"})
	}
	c.WaitReadyEndpoints(t, "default", "db", 2)
	// "all" publishes not-ready addresses: its slice must hold all three
	// before the agent reads it (the controller writes it on its own time).
	c.WaitEndpointSlices(t, "default", "all", func(slices []discoveryv1.EndpointSlice) bool {
		n := 0
		for _, s := range slices {
			n += len(s.Endpoints)
		}
		return n == 3
	})

	a := startAgent(t, c, node)
	t.Logf("ready after %v", a.waitReady(60*time.Second))
	webV4, webV6 := web.Spec.ClusterIPs[0], web.Spec.ClusterIPs[1]
	const d = ".default.svc.cluster.local."
	tests := []struct {
		name  string
		qtype uint16
		want  string
	}{
		{"web" + d, dns.TypeA, webV4},
		{"web" + d, dns.TypeAAAA, netip.MustParseAddr(webV6).String()},
		{"_http._tcp.web" + d, dns.TypeSRV, "SRV:80:web" + d},
		{"_dns._udp.web" + d, dns.TypeSRV, "SRV:53:web" + d},
		{reverse(webV4), dns.TypePTR, "PTR:web" + d},
		{reverse(webV6), dns.TypePTR, "PTR:web" + d},
		{"api" + d, dns.TypeA, api.Spec.ClusterIP},
		{"api" + d, dns.TypeAAAA, "NODATA"},
		{"db" + d, dns.TypeA, "10.244.1.5 10.244.2.7"},
		{"db-0.db" + d, dns.TypeA, "10.244.1.5"},
		{"db-1.db" + d, dns.TypeA, "NXDOMAIN"}, // not ready
		{"10-244-2-7.db" + d, dns.TypeA, "10.244.2.7"},
		{"_sql._tcp.db" + d, dns.TypeSRV, "SRV:5432:10-244-2-7.db" + d + " SRV:5432:db-0.db" + d},
		{reverse("10.244.1.5"), dns.TypePTR, "PTR:10-244-1-5.all" + d + " PTR:db-0.db" + d}, // an endpoint of two headless Services
		{"all" + d, dns.TypeA, "10.244.1.5 10.244.1.6 10.244.2.7"},
		{"ext" + d, dns.TypeA, "192.0.2.80 CNAME:ext.example.org."},
		{"ext" + d, dns.TypeCNAME, "CNAME:ext.example.org."},
		{"10-244-9-9.default.pod.cluster.local.", dns.TypeA, "10.244.9.9"},
		{"nope" + d, dns.TypeA, "NXDOMAIN"},
		{"default.svc.cluster.local.", dns.TypeA, "NODATA"},
		{"ext.example.org.", dns.TypeA, "192.0.2.80"},
	}
	for _, tt := range tests {
		if got := a.ask("", tt.name, tt.qtype); got != tt.want {
			t.Errorf("%s %s = %q, want %q", tt.name, dns.TypeToString[tt.qtype], got, tt.want)
		}
	}
	// NODATA and NXDOMAIN carry the cluster domain's SOA and are
	// authoritative.
	for _, q := range []struct {
		name  string
		qtype uint16
	}{{"api" + d, dns.TypeAAAA}, {"nope" + d, dns.TypeA}} {
		resp, err := a.query("", q.name, q.qtype)
		if err != nil {
			t.Fatal(err)
		}
		if !resp.Authoritative || len(resp.Ns) != 1 || resp.Ns[0].Header().Rrtype != dns.TypeSOA || resp.Ns[0].Header().Name != "cluster.local." {
			t.Errorf("%s: want an authoritative answer with the cluster.local SOA, got %v", q.name, resp)
		}
	}
}

// Creates, readiness flips and deletes show in DNS within 250 ms of the API
// write that carries them.
func TestUpdateLatency(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	const n = 20
	for i := range n {
		c.CreateService(t, kubetest.Service{Namespace: "default", Name: fmt.Sprintf("flip%d", i), Headless: true})
		c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: fmt.Sprintf("flip%d", i), Node: node,
			Labels: map[string]string{"app": fmt.Sprintf("flip%d", i)}, IPs: []string{fmt.Sprintf("10.244.3.%d", i+1)}, Ready: false})
	}
	a := startAgent(t, c, node)
	a.waitReady(60 * time.Second)

	// The test's own watch of EndpointSlices stamps when the controller's
	// write reaches a watcher: the API write a readiness flip shows through.
	sliceSeen := watchSlices(t, c)

	var create, flip, flipFromPod, del []time.Duration
	for i := range n {
		start := time.Now()
		svc := c.CreateService(t, kubetest.Service{Namespace: "default", Name: fmt.Sprintf("new%d", i)})
		create = append(create, a.waitAnswer(start, svc.Name+".default.svc.cluster.local.", dns.TypeA, svc.Spec.ClusterIP, 5*time.Second))
	}
	for i := range n {
		name := fmt.Sprintf("flip%d", i)
		start := time.Now()
		c.SetPodReady(t, "default", name, true)
		fromPod := a.waitAnswer(start, name+".default.svc.cluster.local.", dns.TypeA, fmt.Sprintf("10.244.3.%d", i+1), 5*time.Second)
		written := sliceSeen(name, start)
		flipFromPod = append(flipFromPod, fromPod)
		flip = append(flip, fromPod-written.Sub(start))
	}
	for i := range n {
		name := fmt.Sprintf("new%d", i)
		start := time.Now()
		c.DeleteService(t, "default", name)
		del = append(del, a.waitAnswer(start, name+".default.svc.cluster.local.", dns.TypeA, "NXDOMAIN", 5*time.Second))
	}
	for _, r := range []struct {
		what string
		ds   []time.Duration
	}{
		{"create Service -> answered", create},
		{"EndpointSlice write -> readiness flip answered", flip},
		{"Pod status write -> readiness flip answered (includes the controller)", flipFromPod},
		{"delete Service -> NXDOMAIN", del},
	} {
		t.Logf("%-70s n=%d p50 %v max %v", r.what, len(r.ds), percentile(r.ds, 0.5).Round(100*time.Microsecond), percentile(r.ds, 1).Round(100*time.Microsecond))
	}
	for _, r := range [][]time.Duration{create, flip, del} {
		if m := percentile(r, 1); m > 250*time.Millisecond {
			t.Errorf("an update took %v to show in DNS, want <= 250ms", m)
		}
	}
}

// watchSlices watches EndpointSlices and returns a function that waits for
// the first change to a Service's slices after since and returns when it
// was seen.
func watchSlices(t *testing.T, c *cluster) func(svc string, since time.Time) time.Time {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w, err := c.AdminClient().DiscoveryV1().EndpointSlices("default").Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string][]time.Time{}
	go func() {
		for ev := range w.ResultChan() {
			if es, ok := ev.Object.(*discoveryv1.EndpointSlice); ok {
				mu.Lock()
				svc := es.Labels[discoveryv1.LabelServiceName]
				seen[svc] = append(seen[svc], time.Now())
				mu.Unlock()
			}
		}
	}()
	return func(svc string, since time.Time) time.Time {
		t.Helper()
		var at time.Time
		if !testenv.WaitFor(5*time.Second, func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, ts := range seen[svc] {
				if ts.After(since) {
					at = ts
					return true
				}
			}
			return false
		}) {
			t.Fatalf("no EndpointSlice change of %s seen", svc)
		}
		return at
	}
}

// Two pods of this node in two namespaces that both have a Service "web":
// bare and search-expanded names answer each pod's own namespace. A pod of
// another node is not watched, so its client namespace is unknown.
func TestClientNamespaces(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	ips := map[string]string{}
	for _, ns := range []string{"team-a", "team-b"} {
		c.EnsureNamespace(t, ns)
		ips[ns] = c.CreateService(t, kubetest.Service{Namespace: ns, Name: "web"}).Spec.ClusterIP
	}
	c.EnsureNamespace(t, "team-c")
	// Pod IPs on loopback aliases, so the test can send from them.
	c.CreatePod(t, kubetest.Pod{Namespace: "team-a", Name: "client", Node: node, IPs: []string{"127.0.0.2"}, Ready: true})
	c.CreatePod(t, kubetest.Pod{Namespace: "team-b", Name: "client", Node: node, IPs: []string{"127.0.0.3"}, Ready: true})
	c.CreatePod(t, kubetest.Pod{Namespace: "team-c", Name: "client", Node: "node-b", IPs: []string{"127.0.0.4"}, Ready: true})
	a := startAgent(t, c, node)
	a.waitReady(60 * time.Second)
	if !testenv.WaitFor(5*time.Second, func() bool { return a.metric(`meshdns_names_source_clients{source="kubernetes"}`) == 2 }) {
		t.Fatalf("clients known = %v, want 2 (the pods of %s only)", a.metric(`meshdns_names_source_clients{source="kubernetes"}`), node)
	}
	webA, webB := ips["team-a"], ips["team-b"]
	tests := []struct {
		from, name, want string
	}{
		{"127.0.0.2", "web.", webA},
		{"127.0.0.3", "web.", webB},
		{"127.0.0.2", "web.team-a.svc.cluster.local.", webA}, // the first search expansion of "web" in team-a
		{"127.0.0.3", "web.team-b.svc.cluster.local.", webB},
		{"127.0.0.2", "web.team-b.", webB},
		// "web.team-b" from a team-a pod: its first search expansion is
		// answered in one round trip (autopath CNAME + A).
		{"127.0.0.2", "web.team-b.team-a.svc.cluster.local.", webB + " CNAME:web.team-b.svc.cluster.local."},
		{"127.0.0.3", "web.team-a.team-b.svc.cluster.local.", webA + " CNAME:web.team-a.svc.cluster.local."},
		// A pod of another node: unknown, and "web" is in two namespaces:
		// not answered here (forwarded: the fake upstream says NXDOMAIN).
		{"127.0.0.4", "web.", "NXDOMAIN"},
	}
	for _, tt := range tests {
		if got := a.ask(tt.from, tt.name, dns.TypeA); got != tt.want {
			t.Errorf("from %s: %s = %q, want %q", tt.from, tt.name, got, tt.want)
		}
	}
}

// The API server is killed and restarted while queries flow: no query
// fails, /readyz stays 200, the staleness metric shows the outage, and a
// change made after it is back is answered within 2 s.
func TestAPIServerRestart(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	web := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})
	a := startAgent(t, c, node)
	a.waitReady(60 * time.Second)

	flow := a.queryWhile(
		query{"web.default.svc.cluster.local.", web.Spec.ClusterIP},
		query{"ext.example.org.", "192.0.2.80"},
	)

	c.StopAPIServer()
	stopped := time.Now()
	if !testenv.WaitFor(10*time.Second, func() bool { return a.metric(`meshdns_names_source_stale_seconds{source="kubernetes"}`) > 0 }) {
		t.Fatalf("the staleness metric never showed the outage")
	}
	if code, body := a.get("/readyz"); code != 200 {
		t.Fatalf("/readyz during the outage = %d %s, want 200 (the last state keeps serving)", code, body)
	}
	time.Sleep(time.Second) // an outage of a second or more while queries flow
	c.StartAPIServer(t)
	back := time.Now()
	t.Logf("API server down for %v", back.Sub(stopped).Round(time.Millisecond))
	svc := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "after"})
	took := a.waitAnswer(back, "after.default.svc.cluster.local.", dns.TypeA, svc.Spec.ClusterIP, 10*time.Second)
	t.Logf("a Service created after the API server is back answers %v after it is ready", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("change after the restart answered after %v, want <= 2s", took)
	}
	if !testenv.WaitFor(5*time.Second, func() bool { return a.metric(`meshdns_names_source_stale_seconds{source="kubernetes"}`) == 0 }) {
		t.Errorf("staleness metric did not return to 0")
	}
	sent, failed, failures := flow()
	t.Logf("%d queries during the outage and restart, %d failed", sent, failed)
	for _, f := range failures {
		t.Errorf("failed: %s", f)
	}
}

// /readyz is 503 until every watched kind has synced once, and says what
// is missing: here the agent's role lacks pods.
func TestNotReadyUntilSynced(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	role, err := c.AdminClient().RbacV1().ClusterRoles().Get(ctx, "meshdns-test-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	role.Rules = slices.DeleteFunc(role.Rules, func(r rbacv1.PolicyRule) bool { return slices.Contains(r.Resources, "pods") })
	if _, err := c.AdminClient().RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, c, node)
	var body string
	if !testenv.WaitFor(15*time.Second, func() bool {
		var code int
		code, body = a.get("/readyz")
		return code == 503 && strings.Contains(body, "pods") && strings.Contains(body, "forbidden")
	}) {
		t.Fatalf("/readyz = %q, want 503 naming the forbidden pods", body)
	}
	t.Logf("/readyz without pods: %s", strings.TrimSpace(body))
	if role, err = c.AdminClient().RbacV1().ClusterRoles().Get(ctx, "meshdns-test-agent", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	role.Rules = append(role.Rules, rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}})
	if _, err := c.AdminClient().RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Logf("ready %v after the role was fixed", a.waitReady(60*time.Second).Round(time.Millisecond))
}
