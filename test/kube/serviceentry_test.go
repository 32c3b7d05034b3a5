package kube

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Istio ServiceEntries from the real CRD: spec.addresses, status.addresses
// (Istio's allocator), our own VIP, resolution NONE, exportTo ".", a
// wildcard host, and a Service beating a ServiceEntry of the same host;
// `meshdns-ebpf table` shows them.
func TestServiceEntries(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	c.InstallServiceEntryCRD(t)
	for _, ns := range []string{"team-a", "team-b", "infra"} {
		c.EnsureNamespace(t, ns)
	}
	// Clients of this node on loopback aliases.
	c.CreatePod(t, kubetest.Pod{Namespace: "team-a", Name: "client", Node: node, IPs: []string{"127.0.0.2"}, Ready: true})
	c.CreatePod(t, kubetest.Pod{Namespace: "team-b", Name: "client", Node: node, IPs: []string{"127.0.0.3"}, Ready: true})
	web := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})

	createServiceEntries(t, c)

	a := startAgent(t, c, node)
	t.Logf("ready after %v", a.waitReady(60*time.Second).Round(time.Millisecond))

	vipV4, vipV6 := vipOf(vipHome("vip.example.com."))
	orgV4, orgV6 := vipOf(vipHome("vip.example.org."))
	statusHome := vipHome("status.example.com.")
	if homes := map[int]bool{vipHome("vip.example.com."): true, vipHome("vip.example.org."): true, statusHome: true}; len(homes) != 3 {
		t.Fatal("the test's VIP hosts collide: pick other names")
	}
	// Before Istio's allocator writes status.addresses: our VIP.
	stV4, stV6 := vipOf(statusHome)
	a.waitAnswer(time.Now(), "status.example.com.", dns.TypeA, stV4, 5*time.Second)
	tests := []struct {
		from, name string
		qtype      uint16
		want       string
	}{
		{"", "api.example.com.", dns.TypeA, "192.0.2.10"},
		{"", "api.example.com.", dns.TypeAAAA, "2001:db8::10"},
		{"", reverse("192.0.2.10"), dns.TypePTR, "PTR:api.example.com."},
		{"", "status.example.com.", dns.TypeAAAA, stV6},
		{"", "vip.example.com.", dns.TypeA, vipV4},
		{"", "vip.example.com.", dns.TypeAAAA, vipV6},
		{"", "vip.example.org.", dns.TypeA, orgV4},
		{"", "vip.example.org.", dns.TypeAAAA, orgV6},
		{"", reverse(vipV4), dns.TypePTR, "PTR:vip.example.com."},
		{"", reverse(vipV6), dns.TypePTR, "PTR:vip.example.com."},
		{"", reverse(orgV4), dns.TypePTR, "PTR:vip.example.org."},
		// Resolution NONE without addresses: not ours (forwarded; the
		// fake upstream does not know it).
		{"", "none.example.com.", dns.TypeA, "NXDOMAIN"},
		// exportTo ".": clients of team-a only; team-b and unknown clients
		// get the upstream's answer.
		{"127.0.0.2", "private.example.com.", dns.TypeA, "192.0.2.20"},
		{"127.0.0.3", "private.example.com.", dns.TypeA, "NXDOMAIN"},
		{"", "private.example.com.", dns.TypeA, "NXDOMAIN"},
		{"", "foo.wild.example.com.", dns.TypeA, "192.0.2.30"},
		{"", "a.b.wild.example.com.", dns.TypeA, "192.0.2.30"},
		{"", "wild.example.com.", dns.TypeA, "NXDOMAIN"},
		// A Service beats a ServiceEntry of the same host.
		{"", "web.default.svc.cluster.local.", dns.TypeA, web.Spec.ClusterIP},
	}
	for _, tt := range tests {
		if got := a.ask(tt.from, tt.name, tt.qtype); got != tt.want {
			t.Errorf("from %q: %s %s = %q, want %q", tt.from, tt.name, dns.TypeToString[tt.qtype], got, tt.want)
		}
	}

	// Istio's allocator writes status.addresses: they replace our VIP.
	start := time.Now()
	setSEStatusAddresses(t, c, "infra", "status", [2]string{"status.example.com", "240.240.200.7"}, [2]string{"status.example.com", "2001:2::f0f0:c807"})
	took := a.waitAnswer(start, "status.example.com.", dns.TypeA, "240.240.200.7", 5*time.Second)
	if got := a.ask("", "status.example.com.", dns.TypeAAAA); got != "2001:2::f0f0:c807" {
		t.Errorf("status.example.com AAAA = %q after status.addresses, want 2001:2::f0f0:c807", got)
	}
	if got := a.ask("", reverse("240.240.200.7"), dns.TypePTR); got != "PTR:status.example.com." {
		t.Errorf("PTR of the status address = %q", got)
	}
	t.Logf("status.addresses written -> answered in %v", took.Round(time.Millisecond))

	// The Service goes: the ServiceEntry of its host answers.
	start = time.Now()
	c.DeleteService(t, "default", "web")
	took = a.waitAnswer(start, "web.default.svc.cluster.local.", dns.TypeA, "192.0.2.99", 5*time.Second)
	t.Logf("Service deleted -> the ServiceEntry of its host answers in %v", took.Round(time.Millisecond))

	checkServiceEntryTable(t, a, vipV4, vipV6)
}

// createServiceEntries makes TestServiceEntries' entries: addresses in spec,
// in status (written later), a VIP of ours, resolution NONE, exportTo ".", a
// wildcard host, and one of a Service's host.
func createServiceEntries(t *testing.T, c *cluster) {
	createSE(t, c, "infra", "addr", map[string]any{"hosts": strs("api.example.com"), "resolution": "DNS",
		"addresses": strs("192.0.2.10", "2001:db8::10"), "ports": []any{map[string]any{"number": int64(443), "name": "https", "protocol": "TLS"}}})
	createSE(t, c, "infra", "status", map[string]any{"hosts": strs("status.example.com"), "resolution": "DNS",
		"ports": []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
	createSE(t, c, "infra", "vip", map[string]any{"hosts": strs("vip.example.com", "vip.example.org"), "resolution": "DNS",
		"ports": []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
	createSE(t, c, "infra", "none", map[string]any{"hosts": strs("none.example.com"), "resolution": "NONE",
		"ports": []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
	createSE(t, c, "team-a", "private", map[string]any{"hosts": strs("private.example.com"), "resolution": "STATIC",
		"addresses": strs("192.0.2.20"), "exportTo": strs("."),
		"endpoints": []any{map[string]any{"address": "192.0.2.21"}},
		"ports":     []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
	createSE(t, c, "infra", "wild", map[string]any{"hosts": strs("*.wild.example.com"), "resolution": "NONE",
		"addresses": strs("192.0.2.30"), "ports": []any{map[string]any{"number": int64(443), "name": "tls", "protocol": "TLS"}}})
	createSE(t, c, "default", "web", map[string]any{"hosts": strs("web.default.svc.cluster.local"), "resolution": "STATIC",
		"addresses": strs("192.0.2.99"), "endpoints": []any{map[string]any{"address": "192.0.2.98"}},
		"ports": []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
}

// checkServiceEntryTable: what `meshdns-ebpf table` and the ndsz views show
// of the ServiceEntries.
func checkServiceEntryTable(t *testing.T, a *agent, vipV4, vipV6 string) {
	// What `meshdns-ebpf table` shows.
	t.Logf("meshdns-ebpf table --source serviceentries:\n%s", cli(t, "table", "--admin", a.admin, "--source", "serviceentries"))
	var entries []struct {
		Name, Type, Source, Object string
		Addresses, VisibleTo       []string
	}
	cliJSON(t, &entries, "table", "--admin", a.admin, "--name", "example.com")
	got := map[string]string{}
	for _, e := range entries {
		got[e.Name] = fmt.Sprintf("%s %s %s %s visible:%s", e.Type, strings.Join(e.Addresses, ","), e.Source, e.Object, strings.Join(e.VisibleTo, ","))
	}
	for name, want := range map[string]string{
		"api.example.com":     "host 192.0.2.10,2001:db8::10 serviceentries infra/addr visible:*",
		"vip.example.com":     fmt.Sprintf("vip %s,%s serviceentries infra/vip visible:*", vipV4, vipV6),
		"private.example.com": "host 192.0.2.20 serviceentries team-a/private visible:team-a",
		"*.wild.example.com":  "host 192.0.2.30 serviceentries infra/wild visible:*",
	} {
		if got[name] != want {
			t.Errorf("table: %s = %q, want %q", name, got[name], want)
		}
	}
	// Istio's /debug/ndsz view of a team-b pod: no private.example.com.
	var nds struct {
		Table map[string]struct {
			IPs      []string `json:"ips"`
			Registry string   `json:"registry"`
		} `json:"table"`
	}
	if err := json.Unmarshal([]byte(cli(t, "table", "--admin", a.admin, "-o", "ndsz", "--client-namespace", "team-b")), &nds); err != nil {
		t.Fatal(err)
	}
	if _, ok := nds.Table["private.example.com"]; ok || nds.Table["api.example.com"].Registry != "External" || len(nds.Table["vip.example.com"].IPs) != 2 {
		t.Errorf("ndsz for team-b: %+v", nds.Table)
	}
	code, body := a.get("/debug/ndsz?proxyID=client.team-a")
	if code != http.StatusOK || !strings.Contains(body, `"private.example.com"`) {
		t.Errorf("/debug/ndsz?proxyID=client.team-a = %d, want private.example.com in:\n%s", code, body)
	}
}

// A VIP is the same on every node and across restarts whatever order the
// ServiceEntries arrive in, and never moves while its host exists. The
// hosts collide on purpose: A and B have the same home slot s, C's home is
// s+1. Agent X sees them created one by one (A, B, C, a second apart);
// agent Y starts when all exist and lists them in name order (C's entry
// first, then B's, then A's) in one batch. Both give A s, B s+1 (probed
// past A), C s+2 (its home taken by B), because both allocate in creation
// order. A restart of X gives the same.
func TestServiceEntryVIPStable(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	c.InstallServiceEntryCRD(t)
	hostA, hostB, hostC := collidingHosts(t)
	s := vipHome(hostA + ".")
	t.Logf("hosts %s and %s share the home slot %d; %s's home is %d", hostA, hostB, s, hostC, s+1)

	x := startAgent(t, c, node)
	x.waitReady(60 * time.Second)
	var last *unstructured.Unstructured
	for _, e := range []struct{ obj, host string }{{"z-a", hostA}, {"y-b", hostB}, {"x-c", hostC}} {
		if last != nil {
			// Creation timestamps have whole seconds: create the next one
			// in a later second, so creation order is unambiguous.
			created := last.GetCreationTimestamp().Time
			if !testenv.WaitFor(3*time.Second, func() bool { return time.Now().Truncate(time.Second).After(created) }) {
				t.Fatal("the clock did not pass the last creation second")
			}
		}
		last = createSE(t, c, "default", e.obj, map[string]any{"hosts": strs(e.host), "resolution": "DNS",
			"ports": []any{map[string]any{"number": int64(443), "name": "https", "protocol": "TLS"}}})
		if !testenv.WaitFor(5*time.Second, func() bool { return slotOf(x.ask("", e.host+".", dns.TypeA)) > 0 }) {
			t.Fatalf("agent X never answered %s", e.host)
		}
	}
	want := map[string]int{hostA: s, hostB: s%65534 + 1, hostC: (s+1)%65534 + 1}
	slots := func(a *agent) map[string]int {
		out := map[string]int{}
		for h := range want {
			out[h] = slotOf(a.ask("", h+".", dns.TypeA))
			v4, v6 := vipOf(out[h])
			if got := a.ask("", h+".", dns.TypeAAAA); got != v6 || a.ask("", h+".", dns.TypeA) != v4 {
				t.Errorf("%s: A/AAAA are not the pair of slot %d (AAAA %s)", h, out[h], got)
			}
		}
		return out
	}
	check := func(who string, got map[string]int) {
		t.Helper()
		for h, w := range want {
			if got[h] != w {
				t.Errorf("%s: %s has slot %d, want %d", who, h, got[h], w)
			}
		}
		t.Logf("%s: slots %v", who, got)
	}
	check("X (saw each create)", slots(x))
	y := startAgent(t, c, node)
	y.waitReady(60 * time.Second)
	check("Y (listed all at start)", slots(y))
	x.Stop(agenttest.StopGrace)
	x2 := startAgent(t, c, node)
	x2.waitReady(60 * time.Second)
	check("X restarted", slots(x2))

	// Never moves: A goes; B and C keep their slots on the running agent.
	// A fresh agent gives B its home slot now: the one case where two
	// agents disagree (docs/kubernetes.md), until B and C are recreated or
	// the agents restart.
	deleteSE(t, c, "default", "z-a")
	x2.waitAnswer(time.Now(), hostA+".", dns.TypeA, "NXDOMAIN", 5*time.Second)
	delete(want, hostA)
	check("X restarted, after A was deleted", slots(x2))
	z := startAgent(t, c, node)
	z.waitReady(60 * time.Second)
	zs := map[string]int{hostB: slotOf(z.ask("", hostB+".", dns.TypeA)), hostC: slotOf(z.ask("", hostC+".", dns.TypeA))}
	t.Logf("fresh agent after A was deleted: slots %v (B at its home: the documented disagreement)", zs)
	if zs[hostB] != s || zs[hostC] != s%65534+1 {
		t.Errorf("fresh agent after A was deleted: %v, want B at %d and C at %d", zs, s, s%65534+1)
	}
}

// collidingHosts finds three host names: a and b with the same home slot
// s, and c with home s+1, named so that c < b < a. Allocating in name
// order would then give c s+1, b s and a s+2: the test tells creation
// order from name order.
func collidingHosts(t *testing.T) (a, b, c string) {
	t.Helper()
	bySlot := map[int][]string{}
	for i := 0; i < 5_000_000; i++ {
		h := fmt.Sprintf("h%d.collide.example", i)
		s := vipHome(h + ".")
		bySlot[s] = append(bySlot[s], h)
		for _, s := range []int{s, s - 1} { // h may complete a pair at s or be the c of s-1
			pair, next := bySlot[s], bySlot[s+1]
			if len(pair) < 2 || s < 1 || s >= 65533 {
				continue
			}
			b, a := min(pair[0], pair[1]), max(pair[0], pair[1])
			for _, c := range next {
				if c < b {
					return a, b, c
				}
			}
		}
	}
	t.Fatal("no colliding host names found")
	return "", "", ""
}

// The CRD installed after the agent is ready: a ServiceEntry created then
// answers within 2 s; the CRD deleted: its names are gone. Readiness never
// depends on it.
func TestServiceEntryCRDLater(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	a := startAgent(t, c, node)
	t.Logf("ready without the CRD after %v", a.waitReady(60*time.Second).Round(time.Millisecond))

	start := time.Now()
	c.InstallServiceEntryCRD(t)
	t.Logf("CRD installed in %v (kube-apiserver's 2 s create hold included)", time.Since(start).Round(time.Millisecond))
	start = time.Now()
	createSE(t, c, "default", "late", map[string]any{"hosts": strs("late.example.com"), "resolution": "STATIC",
		"addresses": strs("192.0.2.40"), "endpoints": []any{map[string]any{"address": "192.0.2.41"}},
		"ports": []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
	took := a.waitAnswer(start, "late.example.com.", dns.TypeA, "192.0.2.40", 10*time.Second)
	t.Logf("ServiceEntry created after the CRD appeared -> answered in %v", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("answered after %v, want <= 2s", took)
	}
	createSE(t, c, "default", "late-vip", map[string]any{"hosts": strs("late-vip.example.com"), "resolution": "DNS",
		"ports": []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}})
	if !testenv.WaitFor(2*time.Second, func() bool { return slotOf(a.ask("", "late-vip.example.com.", dns.TypeA)) > 0 }) {
		t.Errorf("late-vip.example.com never got a VIP")
	}

	start = time.Now()
	c.UninstallServiceEntryCRD(t)
	gone := time.Since(start)
	took = a.waitAnswer(start, "late.example.com.", dns.TypeA, "NXDOMAIN", 10*time.Second)
	a.waitAnswer(start, "late-vip.example.com.", dns.TypeA, "NXDOMAIN", 2*time.Second)
	t.Logf("CRD deleted (gone from the API after %v) -> its names gone after %v", gone.Round(time.Millisecond), took.Round(time.Millisecond))
	if code, body := a.get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz = %d %s after the CRD went", code, body)
	}
	if st := a.sources(t)["serviceentries"]; !st.Synced || st.Objects != 0 {
		t.Errorf("serviceentries source after the CRD went: %+v", st)
	}
}
