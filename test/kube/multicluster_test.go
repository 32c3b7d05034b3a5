package kube

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// meshClusters are two real API servers (the remote one on the local one's
// etcd under its own prefix) with the Services the multicluster tests use:
//
//	web        ClusterIP in both
//	only-east  ClusterIP in the remote cluster only
//	db         headless in both: db-0 (10.244.1.5) here, db-1 (10.245.1.6) there
type meshClusters struct {
	local, east         *cluster
	webLocal, onlyEast  string // ClusterIPs
	eastKubeconfigBytes []byte
}

func startMeshClusters(t *testing.T) *meshClusters {
	t.Helper()
	local := startCluster(t)
	east := startRemote(t, local)
	m := &meshClusters{local: local, east: east}
	m.webLocal = local.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"}).Spec.ClusterIP
	east.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})
	m.onlyEast = east.CreateService(t, kubetest.Service{Namespace: "default", Name: "only-east"}).Spec.ClusterIP
	ports := []corev1.ServicePort{{Name: "sql", Port: 5432, Protocol: corev1.ProtocolTCP}}
	for _, c := range []struct {
		c            *cluster
		pod, ip, nod string
	}{{local, "db-0", "10.244.1.5", node}, {east, "db-1", "10.245.1.6", "east-node-1"}} {
		c.c.CreateService(t, kubetest.Service{Namespace: "default", Name: "db", Headless: true, Ports: ports})
		c.c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: c.pod, Node: c.nod, Labels: map[string]string{"app": "db"},
			IPs: []string{c.ip}, Ready: true, Hostname: c.pod, Subdomain: "db"})
		c.c.WaitReadyEndpoints(t, "default", "db", 1)
	}
	m.eastKubeconfigBytes = readFile(t, east.kubeconfig)
	return m
}

const d = ".default.svc.cluster.local."

// Remote clusters from a kubeconfig directory mounted like a Secret: a
// file added while running answers within 2 s, merged by the documented
// rules; removed, its names go; the remote API server stopped, the last
// state keeps answering, /readyz stays 200 and `status` shows the cluster
// down.
func TestRemoteClusters(t *testing.T) {
	requireRoot(t)
	m := startMeshClusters(t)
	dir := newSecretDir(t)
	dir.write(map[string][]byte{})
	a := startAgent(t, m.local, node, "--remote-kubeconfigs", dir.dir)
	a.waitReady(60 * time.Second)
	if got := a.ask("", "only-east"+d, dns.TypeA); got != "NXDOMAIN" {
		t.Fatalf("only-east before the cluster was added = %q", got)
	}

	start := time.Now()
	dir.write(map[string][]byte{"east": m.eastKubeconfigBytes})
	took := a.waitAnswer(start, "only-east"+d, dns.TypeA, m.onlyEast, 10*time.Second)
	t.Logf("kubeconfig file added -> the remote-only Service answers in %v", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("remote cluster's names after %v, want <= 2s", took)
	}
	a.waitAnswer(start, "db"+d, dns.TypeA, "10.244.1.5 10.245.1.6", 5*time.Second)
	for _, tt := range []struct {
		name  string
		qtype uint16
		want  string
	}{
		{"web" + d, dns.TypeA, m.webLocal},                      // local beats remote for ClusterIP
		{"only-east" + d, dns.TypeA, m.onlyEast},                // remote only: its remote ClusterIP
		{"db" + d, dns.TypeA, "10.244.1.5 10.245.1.6"},          // headless: the union of both clusters' endpoints
		{"db-0.db" + d, dns.TypeA, "10.244.1.5"},                // <hostname>.<svc> from every cluster
		{"db-1.db" + d, dns.TypeA, "10.245.1.6"},                //
		{reverse("10.245.1.6"), dns.TypePTR, "PTR:db-1.db" + d}, //
		{"_sql._tcp.db" + d, dns.TypeSRV, "SRV:5432:db-0.db" + d + " SRV:5432:db-1.db" + d},
	} {
		if got := a.ask("", tt.name, tt.qtype); got != tt.want {
			t.Errorf("%s %s = %q, want %q", tt.name, dns.TypeToString[tt.qtype], got, tt.want)
		}
	}
	t.Logf("meshdns-ebpf table --namespace default:\n%s", cli(t, "table", "--admin", a.admin, "--namespace", "default"))
	var st sourceStatus
	if !testenv.WaitFor(5*time.Second, func() bool { st = a.sources(t)["cluster/east"]; return st.Synced }) || st.Objects != 4 {
		t.Errorf("status of cluster/east: %+v, want synced with 4 objects (kubernetes, web, only-east, db)", st)
	}

	// Removed: its names go; the local ones stay.
	start = time.Now()
	dir.write(map[string][]byte{})
	took = a.waitAnswer(start, "only-east"+d, dns.TypeA, "NXDOMAIN", 10*time.Second)
	a.waitAnswer(start, "db"+d, dns.TypeA, "10.244.1.5", 2*time.Second)
	t.Logf("kubeconfig file removed -> the remote names are gone in %v", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("remote names gone after %v, want <= 2s", took)
	}
	if _, ok := a.sources(t)["cluster/east"]; ok {
		t.Errorf("cluster/east still listed after its kubeconfig was removed")
	}

	// Back, then the remote API server goes away while queries flow.
	dir.write(map[string][]byte{"east": m.eastKubeconfigBytes})
	a.waitAnswer(time.Now(), "only-east"+d, dns.TypeA, m.onlyEast, 10*time.Second)
	a.waitAnswer(time.Now(), "db"+d, dns.TypeA, "10.244.1.5 10.245.1.6", 5*time.Second)
	flow := a.queryWhile(
		query{"web" + d, m.webLocal}, query{"only-east" + d, m.onlyEast},
		query{"db" + d, "10.244.1.5 10.245.1.6"}, query{"db-1.db" + d, "10.245.1.6"},
	)
	m.east.StopAPIServer()
	down := time.Now()
	if !testenv.WaitFor(10*time.Second, func() bool { return a.metric(`meshdns_names_source_stale_seconds{source="cluster/east"}`) > 0 }) {
		t.Fatalf("the staleness metric of cluster/east never showed the outage")
	}
	t.Logf("remote API server down -> seen as down (metric) after %v", time.Since(down).Round(time.Millisecond))
	if !testenv.WaitFor(5*time.Second, func() bool { st = a.sources(t)["cluster/east"]; return !st.FailingSince.IsZero() }) {
		t.Errorf("status does not show cluster/east down: %+v", st)
	}
	t.Logf("status during the outage:\n%s", cli(t, "status", "--admin", a.admin, "--state-dir", t.TempDir(), "--bpffs", t.TempDir()))
	if code, body := a.get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz during the remote outage = %d %s, want 200", code, body)
	}
	// Keep querying through a few seconds of outage (the fault's duration, not
	// a wait: flow's queries run meanwhile).
	time.Sleep(2 * time.Second)
	m.east.StartAPIServer(t)
	if !testenv.WaitFor(10*time.Second, func() bool { return a.metric(`meshdns_names_source_stale_seconds{source="cluster/east"}`) == 0 }) {
		t.Errorf("cluster/east did not recover after its API server came back")
	}
	sent, failed, failures := flow()
	t.Logf("%d queries of local and cached remote names through the remote outage, %d failed", sent, failed)
	for _, f := range failures {
		t.Errorf("failed: %s", f)
	}
}

// Istio's remote secrets (label istio/multiCluster=true, one kubeconfig per
// data key) in the agent's namespace: added, broken (the last state keeps
// serving and status shows why), fixed, deleted.
func TestIstioRemoteSecrets(t *testing.T) {
	requireRoot(t)
	m := startMeshClusters(t)
	const ns = "meshdns-system"
	local := m.local
	local.EnsureNamespace(t, ns)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The istio-remote-secrets component's Role, bound to the agent.
	rules := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch"}}}
	if _, err := local.AdminClient().RbacV1().Roles(ns).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "remote-secrets"}, Rules: rules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := local.AdminClient().RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "remote-secrets"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "remote-secrets"},
		Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: agentUser}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, local, node, "--istio-remote-secrets", "--namespace", ns)
	a.waitReady(60 * time.Second)

	secrets := local.AdminClient().CoreV1().Secrets(ns)
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "istio-remote-secret-east", Labels: map[string]string{"istio/multiCluster": "true"},
		Annotations: map[string]string{"networking.istio.io/cluster": "east"}}, Data: map[string][]byte{"east": m.eastKubeconfigBytes}}
	start := time.Now()
	if _, err := secrets.Create(ctx, sec, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	took := a.waitAnswer(start, "only-east"+d, dns.TypeA, m.onlyEast, 10*time.Second)
	t.Logf("remote secret created -> the remote-only Service answers in %v", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("remote cluster's names after %v, want <= 2s", took)
	}
	a.waitAnswer(start, "db"+d, dns.TypeA, "10.244.1.5 10.245.1.6", 5*time.Second)
	// A secret without the label is not a remote secret.
	other := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "unrelated"}, Data: map[string][]byte{"west": m.eastKubeconfigBytes}}
	if _, err := secrets.Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	// A broken kubeconfig: the last state keeps serving, status says why.
	sec.Data["east"] = []byte("not: [a kubeconfig")
	if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	var st sourceStatus
	if !testenv.WaitFor(5*time.Second, func() bool {
		st = a.sources(t)["cluster/east"]
		return strings.Contains(st.LastError, "kubeconfig") && !st.FailingSince.IsZero()
	}) {
		t.Fatalf("status of cluster/east with a broken kubeconfig: %+v", st)
	}
	t.Logf("broken kubeconfig: cluster/east error %q", st.LastError)
	if got := a.ask("", "only-east"+d, dns.TypeA); got != m.onlyEast {
		t.Errorf("only-east with a broken kubeconfig = %q, want the last state %s", got, m.onlyEast)
	}
	srcs := a.sources(t)
	if _, ok := srcs["cluster/west"]; ok {
		t.Errorf("an unlabelled secret became a cluster: %v", srcs)
	}
	// Fixed again: a fresh watch, healthy.
	sec.Data["east"] = m.eastKubeconfigBytes
	if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(5*time.Second, func() bool { st = a.sources(t)["cluster/east"]; return st.FailingSince.IsZero() }) {
		t.Errorf("cluster/east still failing after the kubeconfig was fixed: %+v", st)
	}
	start = time.Now()
	if err := secrets.Delete(ctx, sec.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	took = a.waitAnswer(start, "only-east"+d, dns.TypeA, "NXDOMAIN", 10*time.Second)
	t.Logf("remote secret deleted -> the remote names are gone in %v", took.Round(time.Millisecond))
	if got := a.ask("", "web"+d, dns.TypeA); got != m.webLocal {
		t.Errorf("web after the remote cluster went = %q, want %s", got, m.webLocal)
	}
	if code, _ := a.get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz = %d", code)
	}
}
