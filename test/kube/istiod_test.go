package kube

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	nds "istio.io/istio/pkg/dns/proto"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/nameview"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The NDS source against a real istiod (pilot-discovery built from
// istio.io/istio, internal/kubetest's istiod fixture) on the test API
// server.

// proxyName is the pod-name part of the agent's proxies at istiod.
const proxyName = "meshdns-test"

// istiodClients are the client pods: one per view on this node, and one
// on another node (unknown namespace).
var istiodClients = map[string]string{"apps": "127.0.0.2", "shop": "127.0.0.3", agentNS: "127.0.0.5"}

const unknownClient = "127.0.0.4"

// meshPopulation creates what the equality is checked over: Services
// (ClusterIP dual-stack, headless with pod names, exportTo "."), and
// ServiceEntries with addresses, without (istiod allocates a VIP), and
// exported to their namespace only.
func meshPopulation(t *testing.T, c *cluster) {
	t.Helper()
	for ns := range istiodClients {
		c.EnsureNamespace(t, ns)
	}
	c.EnsureNamespace(t, "default")
	for ns, ip := range istiodClients {
		c.CreatePod(t, kubetest.Pod{Namespace: ns, Name: "client", Node: node, IPs: []string{ip}, Ready: true})
	}
	c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: "other", Node: "node-b", IPs: []string{unknownClient}, Ready: true})
	c.CreateService(t, kubetest.Service{Namespace: "apps", Name: "web", DualStack: true})
	c.CreateService(t, kubetest.Service{Namespace: "apps", Name: "internal",
		Annotations: map[string]string{"networking.istio.io/exportTo": "."}})
	c.CreateService(t, kubetest.Service{Namespace: "shop", Name: "cart"})
	c.CreateService(t, kubetest.Service{Namespace: "apps", Name: "db", Headless: true,
		Ports: []corev1.ServicePort{{Name: "tcp-sql", Port: 5432, Protocol: corev1.ProtocolTCP}}})
	for i, ip := range []string{"10.244.1.10", "10.244.1.11"} {
		c.CreatePod(t, kubetest.Pod{Namespace: "apps", Name: fmt.Sprintf("db-%d", i), Node: "node-b",
			Labels: map[string]string{"app": "db"}, IPs: []string{ip}, Ready: true,
			Hostname: fmt.Sprintf("db-%d", i), Subdomain: "db"})
	}
	c.WaitReadyEndpoints(t, "apps", "db", 2)
	port := []any{map[string]any{"number": int64(443), "name": "https", "protocol": "TLS"}}
	createSE(t, c, "shop", "static", map[string]any{"hosts": strs("api.static.example.com"),
		"addresses": strs("192.0.2.10"), "ports": port, "resolution": "STATIC",
		"endpoints": []any{map[string]any{"address": "192.0.2.11"}}})
	createSE(t, c, "shop", "auto", map[string]any{"hosts": strs("auto.example.com", "auto2.example.com"),
		"ports": port, "resolution": "DNS"})
	createSE(t, c, "shop", "private", map[string]any{"hosts": strs("private.example.com"),
		"addresses": strs("192.0.2.20"), "ports": port, "resolution": "STATIC", "exportTo": strs("."),
		"endpoints": []any{map[string]any{"address": "192.0.2.21"}}})
	createSE(t, c, "apps", "wild", map[string]any{"hosts": strs("*.wild.example.com"),
		"addresses": strs("192.0.2.30"), "ports": port, "resolution": "NONE"})
}

// startIstiodAgent runs the agent with the NDS source on both loopback
// families (its proxies then get both families' addresses, as a
// dual-stack sidecar); with the Kubernetes source of node (node mode),
// or with no other source (node "").
func startIstiodAgent(t *testing.T, c *cluster, node, addr string, extra ...string) *agent {
	t.Helper()
	port := testenv.FreePort(t)
	args := append([]string{"--istiod", addr, "--namespace", agentNS, "--istiod-proxy-name", proxyName,
		"--listen", fmt.Sprintf("127.0.0.1:%d,[::1]:%d", port, port)}, extra...)
	a := startAgent(t, c, node, args...)
	a.addr = fmt.Sprintf("127.0.0.1:%d", port)
	return a
}

// istiodTable polls istiod's /debug/ndsz for the view of ns until ok
// accepts it.
func istiodTable(t *testing.T, is *kubetest.Istiod, ns string, ok func(*nds.NameTable) error) *nds.NameTable {
	t.Helper()
	var nt *nds.NameTable
	var err error
	if !testenv.WaitFor(60*time.Second, func() bool {
		nt, err = is.NDS(proxyName + "." + ns)
		if err == nil {
			err = ok(nt)
		}
		return err == nil
	}) {
		t.Fatalf("istiod's name table for %s.%s: %v", proxyName, ns, err)
	}
	return nt
}

// has wants every name in nt, a 240.240.0.0/16 VIP for the auto ones, and
// both families for web (dual-stack).
func has(names ...string) func(*nds.NameTable) error {
	return func(nt *nds.NameTable) error {
		for _, n := range names {
			info, ok := nt.Table[n]
			if !ok {
				return fmt.Errorf("no %s yet", n)
			}
			if strings.HasPrefix(n, "auto") && !slices.ContainsFunc(info.Ips, func(s string) bool { return strings.HasPrefix(s, "240.240.") }) {
				return fmt.Errorf("%s has no auto-allocated VIP yet (%v)", n, info.Ips)
			}
			if strings.HasPrefix(n, "web.") && !slices.ContainsFunc(info.Ips, func(s string) bool { return strings.Contains(s, ":") }) {
				return fmt.Errorf("%s has no IPv6 address (%v)", n, info.Ips)
			}
		}
		return nil
	}
}

// wantAnswers is what a name of Istio's table answers: its A and AAAA
// records.
func wantAnswers(info *nds.NameTable_NameInfo) (a, aaaa string) {
	var v4, v6 []string
	for _, s := range info.Ips {
		if ip, err := netip.ParseAddr(s); err == nil && ip.Unmap().Is4() {
			v4 = append(v4, ip.Unmap().String())
		} else if err == nil {
			v6 = append(v6, ip.String())
		}
	}
	join := func(v []string) string {
		if len(v) == 0 {
			return "NODATA"
		}
		slices.Sort(v)
		return strings.Join(slices.Compact(v), " ")
	}
	return join(v4), join(v6)
}

// ndsDiffs compares, name for name, istiod's table with what the agent
// answers a client at from, and what its istiod source holds for that
// client's namespace ns with istiod's names ("" ns: skip the latter).
func ndsDiffs(a *agent, nt *nds.NameTable, from, ns string) []string {
	var diffs []string
	for name, info := range nt.Table {
		q := name
		if strings.HasPrefix(q, "*.") {
			q = "probe" + q[1:]
		}
		wa, w6 := wantAnswers(info)
		if got := a.ask(from, q, dns.TypeA); got != wa {
			diffs = append(diffs, fmt.Sprintf("%s A from %s: agent %q, istiod %q", q, from, got, wa))
		}
		if got := a.ask(from, q, dns.TypeAAAA); got != w6 {
			diffs = append(diffs, fmt.Sprintf("%s AAAA from %s: agent %q, istiod %q", q, from, got, w6))
		}
	}
	if ns == "" {
		return diffs
	}
	code, body := a.get("/debug/table?source=istiod&client=" + ns)
	var entries []nameview.Entry
	if err := json.Unmarshal([]byte(body), &entries); code != 200 || err != nil {
		return append(diffs, fmt.Sprintf("/debug/table: %d %v", code, err))
	}
	for _, e := range entries {
		if _, ok := nt.Table[e.Name]; !ok && e.AliasOf == "" {
			diffs = append(diffs, fmt.Sprintf("%s: the agent's istiod source has it for %s, istiod's table does not", e.Name, ns))
		}
	}
	return diffs
}

// waitNoDiffs polls until the agent answers as istiod's table says.
func waitNoDiffs(t *testing.T, a *agent, nt *nds.NameTable, from, ns string) {
	t.Helper()
	var diffs []string
	if !testenv.WaitFor(30*time.Second, func() bool {
		diffs = ndsDiffs(a, nt, from, ns)
		return len(diffs) == 0
	}) {
		t.Errorf("view %s: %d differences with istiod's /debug/ndsz:\n%s", ns, len(diffs), strings.Join(diffs, "\n"))
	}
}

// commonTable is the names every view has alike: what a client of unknown
// namespace gets.
func commonTable(views map[string]*nds.NameTable) *nds.NameTable {
	out := &nds.NameTable{Table: map[string]*nds.NameTable_NameInfo{}}
	var first *nds.NameTable
	for _, nt := range views {
		first = nt
		break
	}
	for name, info := range first.Table {
		same := true
		for _, nt := range views {
			o := nt.Table[name]
			a4, a6 := wantAnswers(info)
			if o == nil {
				same = false
				break
			}
			if b4, b6 := wantAnswers(o); a4 != b4 || a6 != b6 {
				same = false
				break
			}
		}
		if same {
			out.Table[name] = info
		}
	}
	return out
}

// The agent answers exactly what istiod computed for each view, name for
// name: Services, a headless Service's pod names, ServiceEntries with and
// without addresses (istiod's VIPs), exportTo on Services and
// ServiceEntries. Then changes propagate, TLS with a token works, and an
// istiod restart loses nothing.
func TestIstiodNDS(t *testing.T) {
	requireRoot(t)
	c := startCluster(t)
	// Dual-stack on, so a dual-stack Service's table entry has both
	// families (the agent's proxies listen on both).
	is := c.StartIstiod(t, kubetest.IstiodOptions{Env: []string{"ISTIO_DUAL_STACK=true"}})
	meshPopulation(t, c)
	a := startIstiodAgent(t, c, node, is.GRPCAddr)
	a.waitReady(90 * time.Second)

	views := map[string]*nds.NameTable{}
	views["apps"] = istiodTable(t, is, "apps", has("web.apps.svc.cluster.local", "internal.apps.svc.cluster.local",
		"db.apps.svc.cluster.local", "db-0.db.apps.svc.cluster.local", "api.static.example.com",
		"auto.example.com", "auto2.example.com", "*.wild.example.com"))
	views["shop"] = istiodTable(t, is, "shop", has("web.apps.svc.cluster.local", "private.example.com", "auto.example.com"))
	views[agentNS] = istiodTable(t, is, agentNS, has("web.apps.svc.cluster.local", "auto.example.com"))

	t.Run("equal", func(t *testing.T) {
		// exportTo: the view of apps has the Service exported to apps
		// only and not shop's private ServiceEntry; shop's the reverse.
		if _, ok := views["apps"].Table["private.example.com"]; ok {
			t.Errorf("istiod gave apps shop's private ServiceEntry: the population does not test exportTo")
		}
		if _, ok := views["shop"].Table["internal.apps.svc.cluster.local"]; ok {
			t.Errorf("istiod gave shop apps' exportTo=. Service: the population does not test exportTo")
		}
		total := 0
		for ns, nt := range views {
			waitNoDiffs(t, a, nt, istiodClients[ns], ns)
			total += len(nt.Table)
			var names []string
			for name, info := range nt.Table {
				names = append(names, name+"="+strings.Join(info.Ips, ","))
			}
			slices.Sort(names)
			t.Logf("view %s: %d names: %s", ns, len(names), strings.Join(names, " "))
		}
		common := commonTable(views)
		waitNoDiffs(t, a, common, unknownClient, "")
		t.Logf("0 differences over %d names in %d views, %d names common to all (a client of unknown namespace)", total, len(views), len(common.Table))
		// status, table and the metrics show the source and its views.
		out := cli(t, "status", "--admin", a.admin, "--state-dir", t.TempDir(), "--bpffs", t.TempDir())
		if want := "istiod: istiod " + is.GRPCAddr + ": 3/3 views connected"; !strings.Contains(out, want) {
			t.Errorf("status does not say %q:\n%s", want, out)
		}
		if out := cli(t, "table", "--admin", a.admin, "--source", "istiod", "--client-namespace", "shop"); !strings.Contains(out, "private.example.com") {
			t.Errorf("table --source istiod --client-namespace shop lacks private.example.com:\n%s", out)
		}
		for _, ns := range []string{"apps", "shop", agentNS} {
			if v := a.metric(`meshdns_istiod_connected{view="` + ns + `"}`); v != 1 {
				t.Errorf("meshdns_istiod_connected{view=%q} = %v, want 1", ns, v)
			}
		}

		// A name istiod leaves out of a view is not answered from istiod's
		// tables there. The Istio agent forwards it to the cluster DNS,
		// which knows Services whatever their exportTo and no
		// ServiceEntry: here the Kubernetes source answers the Service,
		// and the ServiceEntry is NXDOMAIN.
		if got := a.ask(istiodClients["apps"], "private.example.com.", dns.TypeA); got != "NXDOMAIN" {
			t.Errorf("shop's exportTo=. ServiceEntry from apps = %q, want NXDOMAIN", got)
		}
		code, body := a.get("/debug/table?name=internal.apps.svc.cluster.local&client=shop")
		if code != 200 || !strings.Contains(body, `"source": "kubernetes"`) || strings.Contains(body, `"source": "istiod"`) {
			t.Errorf("apps' exportTo=. Service as shop's clients get it: want it from the kubernetes source only: %d %s", code, body)
		}
	})

	// The last Pod of shop leaves the node: its view goes (istiod no longer
	// has the proxy), and what only shop saw is no longer answered.
	t.Run("view-goes", func(t *testing.T) {
		c.DeletePod(t, "shop", "client")
		want := "istiod: istiod " + is.GRPCAddr + ": 2/2 views connected"
		if !testenv.WaitFor(30*time.Second, func() bool {
			return strings.Contains(cli(t, "status", "--admin", a.admin, "--state-dir", t.TempDir(), "--bpffs", t.TempDir()), want)
		}) {
			t.Fatalf("status never said %q", want)
		}
		if !testenv.WaitFor(30*time.Second, func() bool { _, err := is.NDS(proxyName + ".shop"); return err != nil }) {
			t.Errorf("istiod still has the proxy of the shop view")
		}
		if got := a.ask(istiodClients["shop"], "private.example.com.", dns.TypeA); got != "NXDOMAIN" {
			t.Errorf("shop's private ServiceEntry after shop's view went = %q, want NXDOMAIN", got)
		}
		if v := a.metric(`meshdns_istiod_connected{view="shop"}`); v != -1 {
			t.Errorf("meshdns_istiod_connected{view=\"shop\"} = %v after the view went, want no such series", v)
		}
	})

	// An agent with the NDS source alone, in agent view: what it answers
	// comes through istiod only.
	solo := startIstiodAgent(t, c, "", is.GRPCAddr, "--istiod-view", "agent")
	solo.waitReady(60 * time.Second)
	t.Run("propagation", func(t *testing.T) { istiodPropagation(t, c, solo) })
	t.Run("tls", func(t *testing.T) { istiodTLS(t, c, is) })
	t.Run("restart", func(t *testing.T) { istiodRestart(t, c, is, solo) })
}

// istiodPropagation measures update -> answer through istiod: a new
// Service, and a ServiceEntry's address change.
func istiodPropagation(t *testing.T, c *cluster, a *agent) {
	const n = 20
	var lat []time.Duration
	for i := range n {
		start := time.Now()
		svc := c.CreateService(t, kubetest.Service{Namespace: "apps", Name: fmt.Sprintf("new-%d", i)})
		lat = append(lat, a.waitAnswer(start, fmt.Sprintf("new-%d.apps.svc.cluster.local.", i), dns.TypeA, svc.Spec.ClusterIP, 30*time.Second))
	}
	for i := range n {
		start := time.Now()
		addr := fmt.Sprintf("192.0.2.%d", 100+i)
		port := []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}}
		createSE(t, c, "shop", fmt.Sprintf("se-%d", i), map[string]any{"hosts": strs(fmt.Sprintf("se-%d.example.com", i)),
			"addresses": strs(addr), "ports": port, "resolution": "STATIC", "endpoints": []any{map[string]any{"address": addr}}})
		lat = append(lat, a.waitAnswer(start, fmt.Sprintf("se-%d.example.com.", i), dns.TypeA, addr, 30*time.Second))
	}
	t.Logf("update -> answer through istiod over %d changes (Service and ServiceEntry creates): p50 %v, p99 %v, max %v",
		len(lat), percentile(lat, 0.5).Round(time.Millisecond), percentile(lat, 0.99).Round(time.Millisecond), slices.Max(lat).Round(time.Millisecond))
}

// istiodTLS runs a second agent over TLS (istiod's CA, a service account
// token of audience istio-ca, as the Istio agent), in agent view.
func istiodTLS(t *testing.T, c *cluster, is *kubetest.Istiod) {
	dir := t.TempDir()
	ca := filepath.Join(dir, "root-cert.pem")
	tok := filepath.Join(dir, "istio-token")
	if err := os.WriteFile(ca, is.RootCert(t), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tok, []byte(c.ServiceAccountToken(t, agentNS, "meshdns-ebpf", "istio-ca")), 0o600); err != nil {
		t.Fatal(err)
	}
	a := startIstiodAgent(t, c, "", is.SecureGRPCAddr, "--istiod-ca-file", ca, "--istiod-token-file", tok,
		"--istiod-san", kubetest.IstiodSAN, "--istiod-view", "agent")
	a.waitReady(60 * time.Second)
	nt := istiodTable(t, is, agentNS, has("web.apps.svc.cluster.local"))
	// One view, for every client.
	waitNoDiffs(t, a, nt, unknownClient, "")

	// Node views over TLS: istiod's identity check lets the token of
	// agentNS claim that namespace only; the other views are refused, and
	// the source says so.
	nv := startIstiodAgent(t, c, node, is.SecureGRPCAddr, "--istiod-ca-file", ca, "--istiod-token-file", tok,
		"--istiod-san", kubetest.IstiodSAN, "--istiod-view", "node", "--istiod-proxy-name", "meshdns-tlsnode")
	nv.waitReady(60 * time.Second)
	if !testenv.WaitFor(30*time.Second, func() bool {
		st := nv.sources(t)["istiod"]
		return strings.Contains(st.LastError, "PermissionDenied")
	}) {
		t.Errorf("node views over TLS: source istiod = %+v, want a PermissionDenied error for the other namespaces' views", nv.sources(t)["istiod"])
	}
	if _, err := is.NDS("meshdns-tlsnode." + agentNS); err != nil {
		t.Errorf("node views over TLS: the agent's own view is not connected: %v", err)
	}

	// A token istiod cannot validate: refused, and the source says why.
	if err := os.WriteFile(tok, []byte("not-a-token"), 0o600); err != nil {
		t.Fatal(err)
	}
	b := startIstiodAgent(t, c, "", is.SecureGRPCAddr, "--istiod-ca-file", ca, "--istiod-token-file", tok,
		"--istiod-san", kubetest.IstiodSAN, "--istiod-view", "agent", "--istiod-proxy-name", "meshdns-badtoken")
	if !testenv.WaitFor(30*time.Second, func() bool {
		st, ok := b.sources(t)["istiod"]
		return ok && !st.Synced && strings.Contains(st.LastError, "Unauthenticated")
	}) {
		t.Errorf("with a bad token: source istiod = %+v, want not synced with an Unauthenticated error", b.sources(t)["istiod"])
	}
	if code, _ := b.get("/readyz"); code == 200 {
		t.Errorf("ready without istiod's table")
	}
}

// istiodRestart kills istiod while the agent a (the NDS source alone)
// serves: every name answered before keeps its answer while istiod is
// down and after it is back, queried continuously; the source reports
// the outage; a change made while it was down is answered once it is
// back.
func istiodRestart(t *testing.T, c *cluster, is *kubetest.Istiod, a *agent) {
	nt := istiodTable(t, is, agentNS, has("web.apps.svc.cluster.local", "auto.example.com"))
	before := map[string]string{}
	for name := range nt.Table {
		if !strings.HasPrefix(name, "*.") {
			before[name] = a.ask("", name, dns.TypeA)
		}
	}
	// Ask every name over and over until stop, counting answers that
	// differ from before.
	stop := make(chan struct{})
	done := make(chan [2]int)
	go func() {
		asked, changed := 0, 0
		for {
			for name, want := range before {
				select {
				case <-stop:
					done <- [2]int{asked, changed}
					return
				default:
				}
				asked++
				if got := a.ask("", name, dns.TypeA); got != want {
					changed++
					t.Errorf("%s = %q, was %q", name, got, want)
				}
			}
		}
	}()
	is.Stop()
	down := time.Now()
	if !testenv.WaitFor(30*time.Second, func() bool {
		return a.metric(`meshdns_names_source_stale_seconds{source="istiod"}`) > 0
	}) {
		t.Errorf("the source does not report istiod down: stale = %v", a.metric(`meshdns_names_source_stale_seconds{source="istiod"}`))
	}
	if st := a.sources(t)["istiod"]; st.FailingSince.IsZero() || st.LastError == "" {
		t.Errorf("status of the istiod source while istiod is down: %+v", st)
	}
	if code, body := a.get("/readyz"); code != 200 {
		t.Errorf("not ready while istiod is down: %d %s", code, body)
	}
	svc := c.CreateService(t, kubetest.Service{Namespace: "apps", Name: "while-down"})
	took := is.Start(t)
	t.Logf("istiod down %v (ready again %v after its start)", time.Since(down).Round(time.Millisecond), took.Round(time.Millisecond))
	lat := a.waitAnswer(time.Now(), "while-down.apps.svc.cluster.local.", dns.TypeA, svc.Spec.ClusterIP, 60*time.Second)
	t.Logf("a Service created while istiod was down: answered %v after istiod was ready", lat.Round(time.Millisecond))
	if !testenv.WaitFor(30*time.Second, func() bool {
		return a.metric(`meshdns_names_source_stale_seconds{source="istiod"}`) == 0
	}) {
		t.Errorf("the source still reports istiod down after it is back")
	}
	close(stop)
	n := <-done
	t.Logf("%d queries for the %d names answered before, while istiod was down and after it was back: %d changed", n[0], len(before), n[1])
}
