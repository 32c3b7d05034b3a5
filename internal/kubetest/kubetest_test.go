package kubetest

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// TestControlPlane starts a real control plane and proves what the other packages'
// tests rely on: dual-stack ClusterIPs, controller-made EndpointSlices with ready
// flags and hostnames, identities and RBAC, an API server restart, an isolated
// second API server, and Istio's ServiceEntry CRD.
func TestControlPlane(t *testing.T) {
	begin := time.Now()
	cp := Start(t, Options{ControllerManager: true, Users: []string{"agent"}})
	cp.EnsureNamespace(t, controlPlaneNS)

	t.Run("Version", func(t *testing.T) { controlPlaneVersion(t, cp) })
	t.Run("DualStackClusterIP", func(t *testing.T) { controlPlaneDualStackClusterIP(t, cp) })
	t.Run("HeadlessReadiness", func(t *testing.T) { controlPlaneHeadlessReadiness(t, cp) })
	t.Run("ExternalName", func(t *testing.T) { controlPlaneExternalName(t, cp) })
	t.Run("ServiceDeleteCollectsSlices", func(t *testing.T) { controlPlaneServiceDeleteCollectsSlices(t, cp) })
	t.Run("Identities", func(t *testing.T) { controlPlaneIdentities(t, cp) })
	t.Run("APIServerRestart", func(t *testing.T) { controlPlaneAPIServerRestart(t, cp) })

	var remotePID int
	t.Run("SecondAPIServer", func(t *testing.T) { controlPlaneSecondAPIServer(t, cp, &remotePID) })
	if remotePID == 0 {
		t.Fatal("second API server did not start")
	}
	if !processGone(remotePID) {
		t.Errorf("second kube-apiserver (pid %d) still runs after its test's cleanup", remotePID)
	}

	t.Run("ServiceEntryCRD", func(t *testing.T) { controlPlaneServiceEntryCRD(t, cp) })

	for _, p := range []*process{cp.etcd, cp.apiserver, cp.kcm} {
		t.Logf("%s memory: %s", p.name, procMemory(p.pid()))
	}
	t.Logf("TestControlPlane: startup %v; whole test %v", cp.Timings, time.Since(begin).Round(time.Millisecond))
}

// controlPlaneNS is the namespace of TestControlPlane's objects.
const controlPlaneNS = "kubetest"

func controlPlaneVersion(t *testing.T, cp *ControlPlane) {
	client := cp.AdminClient()
	v, err := client.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	if v.GitVersion != KubeVersion {
		t.Errorf("server version %q, want %q (the ldflags of scripts/build-kube.sh)", v.GitVersion, KubeVersion)
	}
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if got := requiredVersion(t, filepath.Join(root, "tools", "kube", "go.mod"), "k8s.io/kubernetes"); got != KubeVersion {
		t.Errorf("tools/kube/go.mod requires k8s.io/kubernetes %s, kubetest.KubeVersion is %s: bump both", got, KubeVersion)
	}
}

func controlPlaneDualStackClusterIP(t *testing.T, cp *ControlPlane) {
	const ns = controlPlaneNS
	svc := cp.CreateService(t, Service{Namespace: ns, Name: "web", DualStack: true})
	if len(svc.Spec.ClusterIPs) != 2 {
		t.Fatalf("clusterIPs %v, want one per family", svc.Spec.ClusterIPs)
	}
	for i, cidr := range strings.Split(ServiceCIDRs, ",") {
		if ip := netip.MustParseAddr(svc.Spec.ClusterIPs[i]); !netip.MustParsePrefix(cidr).Contains(ip) {
			t.Errorf("clusterIPs[%d] = %v, not in %s", i, ip, cidr)
		}
	}
	start := time.Now()
	cp.CreatePod(t, Pod{Namespace: ns, Name: "web-1", Node: "node-a", Labels: map[string]string{"app": "web"},
		IPs: []string{"10.244.1.10", "fd00:10:244:1::10"}, Ready: true})
	got := cp.WaitReadyEndpoints(t, ns, "web", 2)
	t.Logf("dual-stack pod -> ready endpoints in both families' slices: %v", time.Since(start).Round(time.Millisecond))
	families := map[discoveryv1.AddressType][]string{}
	for _, s := range got {
		for _, ep := range s.Endpoints {
			families[s.AddressType] = append(families[s.AddressType], ep.Addresses...)
		}
	}
	if !slices.Equal(families[discoveryv1.AddressTypeIPv4], []string{"10.244.1.10"}) ||
		!slices.Equal(families[discoveryv1.AddressTypeIPv6], []string{"fd00:10:244:1::10"}) {
		t.Errorf("slice addresses by family %v", families)
	}
}

func controlPlaneHeadlessReadiness(t *testing.T, cp *ControlPlane) {
	const ns = controlPlaneNS
	cp.CreateService(t, Service{Namespace: ns, Name: "db", Headless: true})
	start := time.Now()
	for i, ready := range []bool{true, true, false} {
		cp.CreatePod(t, Pod{Namespace: ns, Name: fmt.Sprintf("db-%d", i), Node: "node-a",
			Labels: map[string]string{"app": "db"}, IPs: []string{fmt.Sprintf("10.244.1.%d", 20+i)}, Ready: ready,
			Hostname: fmt.Sprintf("db-%d", i), Subdomain: "db"})
	}
	got := cp.WaitEndpointSlices(t, ns, "db", func(s []discoveryv1.EndpointSlice) bool {
		return len(endpointsByHost(s)) == 3
	})
	t.Logf("3 pods -> slice with 3 endpoints: %v", time.Since(start).Round(time.Millisecond))
	want := map[string]string{"db-0": "10.244.1.20 ready=true", "db-1": "10.244.1.21 ready=true", "db-2": "10.244.1.22 ready=false"}
	if byHost := endpointsByHost(got); !maps.Equal(byHost, want) {
		t.Errorf("endpoints by hostname %v, want %v", byHost, want)
	}

	start = time.Now()
	cp.SetPodReady(t, ns, "db-2", true)
	cp.WaitReadyEndpoints(t, ns, "db", 3)
	t.Logf("readiness flip -> slice: %v", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	cp.DeletePod(t, ns, "db-0")
	got = cp.WaitEndpointSlices(t, ns, "db", func(s []discoveryv1.EndpointSlice) bool { return len(endpointsByHost(s)) == 2 })
	t.Logf("pod delete -> slice: %v", time.Since(start).Round(time.Millisecond))
	if _, ok := endpointsByHost(got)["db-0"]; ok {
		t.Errorf("deleted pod db-0 still in %v", endpointsByHost(got))
	}
}

func controlPlaneExternalName(t *testing.T, cp *ControlPlane) {
	const ns = controlPlaneNS
	svc := cp.CreateService(t, Service{Namespace: ns, Name: "search", ExternalName: "search.example.com"})
	if svc.Spec.Type != corev1.ServiceTypeExternalName || svc.Spec.ExternalName != "search.example.com" || len(svc.Spec.ClusterIPs) != 0 {
		t.Errorf("stored %s %q clusterIPs %v", svc.Spec.Type, svc.Spec.ExternalName, svc.Spec.ClusterIPs)
	}
}

func controlPlaneServiceDeleteCollectsSlices(t *testing.T, cp *ControlPlane) {
	const ns = controlPlaneNS
	cp.CreateService(t, Service{Namespace: ns, Name: "gone"})
	cp.WaitEndpointSlices(t, ns, "gone", func(s []discoveryv1.EndpointSlice) bool { return len(s) == 1 })
	start := time.Now()
	cp.DeleteService(t, ns, "gone")
	cp.WaitEndpointSlices(t, ns, "gone", func(s []discoveryv1.EndpointSlice) bool { return len(s) == 0 })
	t.Logf("service delete -> slices garbage-collected: %v", time.Since(start).Round(time.Millisecond))
}

func controlPlaneIdentities(t *testing.T, cp *ControlPlane) {
	client := cp.AdminClient()
	ctx := t.Context()
	// A plain user gets exactly what a ClusterRole of the test grants, as the
	// agent will with the project's shipped role.
	role := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "kubetest-service-reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"services"}, Verbs: []string{"get", "list", "watch"}}},
	}
	if _, err := client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	agent := clientFromKubeconfig(t, cp.Kubeconfig(t, "agent"))
	if _, err := agent.CoreV1().Services("").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("unbound user listed Services: err=%v, want Forbidden", err)
	}
	cp.BindClusterRole(t, role.Name, "agent")
	if !eventually(func() error { _, err := agent.CoreV1().Services("").List(ctx, metav1.ListOptions{}); return err }) {
		t.Fatal("user bound to a Service-reading ClusterRole still cannot list Services")
	}
	if _, err := agent.CoreV1().Pods("").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("user bound to a Service-reading ClusterRole listed Pods: err=%v, want Forbidden", err)
	}

	// A ServiceAccount token, bound to the aggregated ClusterRole view (filled by
	// the controller-manager's clusterrole-aggregation controller).
	sa := clientFromKubeconfig(t, cp.ServiceAccountKubeconfig(t, "kube-system", "meshdns-ebpf"))
	if _, err := sa.CoreV1().Pods("").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Fatalf("unbound ServiceAccount listed Pods: err=%v, want Forbidden", err)
	}
	cp.BindClusterRole(t, "view", "system:serviceaccount:kube-system:meshdns-ebpf")
	if !eventually(func() error { _, err := sa.CoreV1().Pods("").List(ctx, metav1.ListOptions{}); return err }) {
		t.Fatal("ServiceAccount bound to view still cannot list Pods")
	}
}

func controlPlaneAPIServerRestart(t *testing.T, cp *ControlPlane) {
	client := cp.AdminClient()
	ctx := t.Context()
	const ns = controlPlaneNS
	start := time.Now()
	cp.StopAPIServer()
	stopped := time.Since(start)
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	_, err := client.CoreV1().Namespaces().Get(short, "default", metav1.GetOptions{})
	cancel()
	if err == nil {
		t.Fatal("API server answered after StopAPIServer")
	}
	took := cp.StartAPIServer(t)
	t.Logf("kube-apiserver killed in %v, back (ready, same port %s) in %v", stopped.Round(time.Millisecond), cp.Host(), took.Round(time.Millisecond))

	// The controller-manager reconnects on its own: a change made now reaches the
	// slices.
	start = time.Now()
	cp.SetPodReady(t, ns, "db-1", false)
	cp.WaitReadyEndpoints(t, ns, "db", 1)
	t.Logf("readiness flip after the restart -> slice: %v", time.Since(start).Round(time.Millisecond))
}

func controlPlaneSecondAPIServer(t *testing.T, cp *ControlPlane, remotePID *int) {
	client := cp.AdminClient()
	ctx := t.Context()
	const ns = controlPlaneNS
	remote := Start(t, Options{ShareEtcd: cp})
	*remotePID = remote.apiserver.pid()
	t.Logf("second API server on the shared etcd: %v", remote.Timings)
	rc := remote.AdminClient()
	if _, err := rc.CoreV1().Services(ns).Get(ctx, "db", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the second cluster sees the first's Service kubetest/db: err=%v", err)
	}
	remote.EnsureNamespace(t, ns)
	rsvc := remote.CreateService(t, Service{Namespace: ns, Name: "remote-only"})
	if _, err := client.CoreV1().Services(ns).Get(ctx, "remote-only", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the first cluster sees the second's Service: err=%v", err)
	}
	if remote.Host() == cp.Host() || rsvc.Spec.ClusterIP == "" {
		t.Errorf("second API server %s (first %s), ClusterIP %q", remote.Host(), cp.Host(), rsvc.Spec.ClusterIP)
	}
}

func controlPlaneServiceEntryCRD(t *testing.T, cp *ControlPlane) {
	ctx := t.Context()
	const ns = controlPlaneNS
	start := time.Now()
	cp.InstallServiceEntryCRD(t)
	t.Logf("ServiceEntry CRD installed and served: %v", time.Since(start).Round(time.Millisecond))
	se := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.istio.io/v1",
		"kind":       "ServiceEntry",
		"metadata":   map[string]any{"name": "external-db", "namespace": ns},
		"spec": map[string]any{
			"hosts":      []any{"db.example.com"},
			"addresses":  []any{"240.240.1.1"},
			"ports":      []any{map[string]any{"number": int64(5432), "name": "tcp-db", "protocol": "TCP"}},
			"location":   "MESH_EXTERNAL",
			"resolution": "STATIC",
			"endpoints":  []any{map[string]any{"address": "192.0.2.10"}},
		},
	}}
	ses := cp.DynamicClient().Resource(ServiceEntryGVR).Namespace(ns)
	start = time.Now()
	if _, err := ses.Create(ctx, se, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ServiceEntry: %v", err)
	}
	// The server's 2 s hold on creates right after the CRD is established was
	// absorbed by InstallServiceEntryCRD.
	if took := time.Since(start); took > 1500*time.Millisecond {
		t.Errorf("first ServiceEntry create took %v: the CRD-establish hold was not absorbed", took)
	} else {
		t.Logf("first ServiceEntry create: %v", took.Round(time.Millisecond))
	}
	for _, v := range []string{"v1beta1", "v1alpha3"} {
		gvr := schema.GroupVersionResource{Group: ServiceEntryGVR.Group, Version: v, Resource: ServiceEntryGVR.Resource}
		got, err := cp.DynamicClient().Resource(gvr).Namespace(ns).Get(ctx, "external-db", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get ServiceEntry at %s: %v", v, err)
		}
		if hosts, _, _ := unstructured.NestedStringSlice(got.Object, "spec", "hosts"); !slices.Equal(hosts, []string{"db.example.com"}) {
			t.Errorf("%s hosts %v", v, hosts)
		}
	}
	// The real schema is enforced (a hand-written permissive CRD would take it).
	bad := se.DeepCopy()
	bad.SetName("no-hosts")
	unstructured.RemoveNestedField(bad.Object, "spec", "hosts")
	if _, err := ses.Create(ctx, bad, metav1.CreateOptions{}); !apierrors.IsInvalid(err) {
		t.Errorf("ServiceEntry without hosts: err=%v, want Invalid", err)
	}

	start = time.Now()
	cp.UninstallServiceEntryCRD(t)
	t.Logf("ServiceEntry CRD removed: %v", time.Since(start).Round(time.Millisecond))
	if _, err := ses.List(ctx, metav1.ListOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("list ServiceEntries after the CRD is gone: err=%v, want NotFound", err)
	}
}

// procMemory reads a process's resident (VmRSS) and peak resident (VmHWM) memory.
func procMemory(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "VmRSS:") || strings.HasPrefix(line, "VmHWM:") {
			out = append(out, strings.Join(strings.Fields(line), " "))
		}
	}
	return strings.Join(out, ", ")
}

// TestChildrenDieWithTestBinary runs a control plane in a child test binary, kills
// that binary with SIGKILL (no cleanup runs) and checks that etcd and
// kube-apiserver die with it (Pdeathsig).
func TestChildrenDieWithTestBinary(t *testing.T) {
	if os.Getenv("KUBETEST_ORPHAN_HELPER") == "1" {
		cp := Start(t, Options{})
		fmt.Printf("PIDS %d %d\n", cp.etcd.pid(), cp.apiserver.pid())
		select {} // until killed
	}
	binDir(t) // skip (fail under CI) before spawning a helper that would skip
	helper := exec.Command(os.Args[0], "-test.run=^TestChildrenDieWithTestBinary$", "-test.v")
	// The killed helper runs no cleanup: its temporary directories (the control
	// plane's data) go under ours, which this test removes.
	helper.Env = append(os.Environ(), "KUBETEST_ORPHAN_HELPER=1", "TMPDIR="+t.TempDir())
	out, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	helper.Stderr = os.Stderr
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = helper.Process.Kill(); _ = helper.Wait() })
	var pids []int
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "PIDS "); ok {
			for _, f := range strings.Fields(rest) {
				pid, _ := strconv.Atoi(f)
				pids = append(pids, pid)
			}
			break
		}
	}
	if len(pids) != 2 {
		t.Fatalf("helper printed no pids (scan error %v)", sc.Err())
	}
	for _, pid := range pids {
		if processGone(pid) {
			t.Fatalf("pid %d is not running before the helper is killed", pid)
		}
	}
	if err := helper.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = helper.Wait()
	start := time.Now()
	if !testenv.WaitFor(10*time.Second, func() bool { return processGone(pids[0]) && processGone(pids[1]) }) {
		t.Fatalf("etcd (%d) or kube-apiserver (%d) outlived the killed test binary", pids[0], pids[1])
	}
	t.Logf("etcd and kube-apiserver gone %v after the test binary was killed", time.Since(start).Round(time.Millisecond))
}

// eventually polls f until it returns nil (RBAC changes reach the authorizer
// through its informer) and reports whether it did within WaitTimeout.
func eventually(f func() error) bool {
	return testenv.WaitFor(WaitTimeout, func() bool { return f() == nil })
}

// processGone reports whether pid no longer exists or is a zombie (killed, not yet
// reaped by init).
func processGone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// Field 3, after the parenthesised command name, is the state.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] == 'Z' || s[i+2] == 'X'
}

func clientFromKubeconfig(t *testing.T, path string) kubernetes.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatalf("load %s: %v", path, err)
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// endpointsByHost maps each endpoint's hostname to "address ready=bool".
func endpointsByHost(slices []discoveryv1.EndpointSlice) map[string]string {
	m := map[string]string{}
	for _, s := range slices {
		for _, ep := range s.Endpoints {
			host := "(none)"
			if ep.Hostname != nil {
				host = *ep.Hostname
			}
			ready := ep.Conditions.Ready != nil && *ep.Conditions.Ready
			m[host] = fmt.Sprintf("%s ready=%v", strings.Join(ep.Addresses, ","), ready)
		}
	}
	return m
}

// requiredVersion reads the version of module mod that go.mod requires.
func requiredVersion(t *testing.T, gomod, mod string) string {
	t.Helper()
	b, err := os.ReadFile(gomod)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "require "))
		if len(f) >= 2 && f[0] == mod {
			return f[1]
		}
	}
	t.Fatalf("%s does not require %s", gomod, mod)
	return ""
}
