package deploy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	appsv1 "k8s.io/api/apps/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/kubelife"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// components lists every component of deploy/kubernetes.
func components(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(manifestsDir(), "components"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, e.Name())
		}
	}
	return out
}

// serviceMonitorCRD is a stand-in for the Prometheus Operator's CRD (the
// ServiceMonitor component needs it to exist): it only lets the API server
// store the object; the operator's own schema is not checked here.
func serviceMonitorCRD() *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "apiextensions.k8s.io/v1",
		"kind":       "CustomResourceDefinition",
		"metadata":   map[string]any{"name": "servicemonitors.monitoring.coreos.com"},
		"spec": map[string]any{
			"group": "monitoring.coreos.com",
			"names": map[string]any{"plural": "servicemonitors", "singular": "servicemonitor", "kind": "ServiceMonitor", "listKind": "ServiceMonitorList"},
			"scope": "Namespaced",
			"versions": []any{map[string]any{"name": "v1", "served": true, "storage": true,
				"schema": map[string]any{"openAPIV3Schema": map[string]any{"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}},
		},
	}}
}

// prometheusRuleCRD stands in for the Prometheus Operator's PrometheusRule CRD, as
// serviceMonitorCRD does for the ServiceMonitor.
func prometheusRuleCRD() *unstructured.Unstructured {
	crd := serviceMonitorCRD()
	crd.SetName("prometheusrules.monitoring.coreos.com")
	_ = unstructured.SetNestedStringMap(crd.Object, map[string]string{"plural": "prometheusrules", "singular": "prometheusrule",
		"kind": "PrometheusRule", "listKind": "PrometheusRuleList"}, "spec", "names")
	return crd
}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installCRD creates a CRD and waits until it is established.
func installCRD(t *testing.T, cp *kubetest.ControlPlane, crd *unstructured.Unstructured) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := cp.DynamicClient().Resource(crdGVR).Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if !testenv.WaitFor(30*time.Second, func() bool {
		u, err := cp.DynamicClient().Resource(crdGVR).Get(ctx, crd.GetName(), metav1.GetOptions{})
		if err != nil {
			return false
		}
		conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, c := range conds {
			if m, ok := c.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
				return true
			}
		}
		return false
	}) {
		t.Fatalf("CRD %s not established", crd.GetName())
	}
	// Established comes before the API server's discovery serves the kind,
	// which is what a REST mapper (kubectl's, the tests' apply) reads.
	group, _, _ := unstructured.NestedString(crd.Object, "spec", "group")
	plural, _, _ := unstructured.NestedString(crd.Object, "spec", "names", "plural")
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	for _, v := range versions {
		name, _, _ := unstructured.NestedString(v.(map[string]any), "name")
		if !testenv.WaitFor(30*time.Second, func() bool {
			l, err := cp.AdminClient().Discovery().ServerResourcesForGroupVersion(group + "/" + name)
			return err == nil && slices.ContainsFunc(l.APIResources, func(r metav1.APIResource) bool { return r.Name == plural })
		}) {
			t.Fatalf("CRD %s: %s/%s %s not in the API server's discovery", crd.GetName(), group, name, plural)
		}
	}
}

// apply server-side applies objects (as kubectl apply --server-side does)
// and returns the first error.
func apply(t *testing.T, cp *kubetest.ControlPlane, objs []object) error {
	t.Helper()
	return eachObject(t, cp, objs, func(ctx context.Context, res dynamic.ResourceInterface, u *unstructured.Unstructured) error {
		body, err := json.Marshal(u)
		if err != nil {
			return err
		}
		if _, err := res.Patch(ctx, u.GetName(), types.ApplyPatchType, body, metav1.PatchOptions{FieldManager: "meshdns-deploy-test", Force: ptr(true)}); err != nil {
			return fmt.Errorf("server-side apply %s %s: %w", u.GetKind(), u.GetName(), err)
		}
		return nil
	})
}

// deleteAll deletes objects in their order, as kubectl delete -k does
// (background propagation; objects already gone are no error).
func deleteAll(t *testing.T, cp *kubetest.ControlPlane, objs []object) error {
	t.Helper()
	return eachObject(t, cp, objs, func(ctx context.Context, res dynamic.ResourceInterface, u *unstructured.Unstructured) error {
		if err := res.Delete(ctx, u.GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete %s %s: %w", u.GetKind(), u.GetName(), err)
		}
		return nil
	})
}

// eachObject calls fn with each object's API resource (in its namespace) and
// the object, in order, and returns the first error.
func eachObject(t *testing.T, cp *kubetest.ControlPlane, objs []object,
	fn func(context.Context, dynamic.ResourceInterface, *unstructured.Unstructured) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(cp.AdminClient().Discovery()))
	for _, o := range objs {
		m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o.obj)
		if err != nil {
			return err
		}
		u := &unstructured.Unstructured{Object: m}
		gvk := u.GroupVersionKind()
		if gvk.Empty() {
			gvks, _, err := scheme().ObjectKinds(o.obj)
			if err != nil {
				return err
			}
			gvk = gvks[0]
			u.SetGroupVersionKind(gvk)
		}
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return fmt.Errorf("%s %s: %w", gvk, u.GetName(), err)
		}
		var res dynamic.ResourceInterface = cp.DynamicClient().Resource(mapping.Resource)
		if ns := u.GetNamespace(); ns != "" {
			res = cp.DynamicClient().Resource(mapping.Resource).Namespace(ns)
		}
		if err := fn(ctx, res, u); err != nil {
			return err
		}
	}
	return nil
}

// Every manifest - the default install and each component - passes
// server-side apply against a real kube-apiserver (its admission and
// validation, not a client-side dry run).
func TestManifestsServerSideApply(t *testing.T) {
	testenv.RequirePrivileged(t)
	cp := kubetest.Start(t, kubetest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	installCRD(t, cp, serviceMonitorCRD())
	installCRD(t, cp, prometheusRuleCRD())
	sets := [][]string{nil}
	for _, c := range components(t) {
		sets = append(sets, []string{c})
	}
	for _, comps := range sets {
		objs := render(t, comps...)
		if err := apply(t, cp, objs); err != nil {
			t.Errorf("components %v: %v", comps, err)
			continue
		}
		t.Logf("components %v: %d objects applied", comps, len(objs))
	}
	// Applied, the DaemonSet is what the API server stored (no kubelet
	// runs here to start it).
	ds, err := cp.AdminClient().AppsV1().DaemonSets("meshdns-system").Get(ctx, "meshdns-ebpf", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if ds.Spec.UpdateStrategy.RollingUpdate == nil || ds.Spec.UpdateStrategy.RollingUpdate.MaxSurge.IntValue() != 1 {
		t.Errorf("stored DaemonSet rolling update: %+v", ds.Spec.UpdateStrategy)
	}
}

// agentRun is the agent as the DaemonSet runs it, but resolver only
// (--mode off: capture is the eBPF suites' job) and with the token of the
// shipped ServiceAccount.
type agentRun struct {
	*agenttest.Process
	addr  string
	admin string
}

func startAgent(t *testing.T, kubeconfig, upstream string) *agentRun {
	t.Helper()
	a := &agentRun{addr: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)), admin: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))}
	a.Process = agenttest.Start(t, agenttest.Command(agenttest.Agent(t), "run", "--mode", "off", "--kubeconfig", kubeconfig, "--node-name", "node-a",
		"--listen", a.addr, "--admin", a.admin, "--upstream", upstream, "--state-dir", t.TempDir()), agenttest.Options{})
	return a
}

func (a *agentRun) readyz() (int, string) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + a.admin + "/readyz")
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

func (a *agentRun) lookup(name string) string {
	m := new(dns.Msg)
	m.SetQuestion(name, dns.TypeA)
	resp, _, err := (&dns.Client{Timeout: time.Second}).Exchange(m, a.addr)
	if err != nil || len(resp.Answer) == 0 {
		return ""
	}
	if r, ok := resp.Answer[0].(*dns.A); ok {
		return r.A.String()
	}
	return ""
}

// The agent, run against the API server with the token of the shipped
// ServiceAccount, bound by the shipped ClusterRole and nothing else, syncs
// and answers. Removing any one rule of that ClusterRole shows it is
// needed: without a rule of the required source (Services, EndpointSlices,
// Pods) the agent does not become ready and /readyz names the resource it
// may not read; without a rule of the optional ServiceEntry source (the CRD,
// the ServiceEntries) the agent is ready all the same (a node's DNS does not
// wait for Istio), the failure shows in the source's metrics and in the log,
// and once the rule is granted again the ServiceEntries come in on their own.
func TestShippedRBACIsExact(t *testing.T) {
	testenv.RequirePrivileged(t)
	cp := kubetest.Start(t, kubetest.Options{})
	// With Istio's CRD installed the agent also lists ServiceEntries, so
	// every rule of the role is used.
	cp.InstallServiceEntryCRD(t)
	objs := render(t)
	if err := apply(t, cp, objs); err != nil {
		t.Fatal(err)
	}
	role := find[*rbacv1.ClusterRole](t, objs, "ClusterRole", "meshdns-ebpf")
	web := cp.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})
	createServiceEntry(t, cp, "default", "api", "api.example.com", "192.0.2.10")
	kubeconfig := cp.ServiceAccountKubeconfig(t, "meshdns-system", "meshdns-ebpf")
	up := testenv.StartFakeDNS(t, nil, "127.0.0.1:0", nil)

	a := startAgent(t, kubeconfig, up.Addr)
	if !testenv.WaitFor(60*time.Second, func() bool {
		code, _ := a.readyz()
		return code == 200 && a.lookup("web.default.svc.cluster.local.") == web.Spec.ClusterIP &&
			a.lookup("api.example.com.") == "192.0.2.10"
	}) {
		code, body := a.readyz()
		t.Fatalf("with the shipped ClusterRole the agent is not ready: %d %s\n%s", code, body, a.Log.String())
	}
	a.Stop(agenttest.StopGrace)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i, rule := range role.Rules {
		what := strings.Join(rule.Resources, ",")
		optional := slices.ContainsFunc(rule.APIGroups, func(g string) bool {
			return g == "networking.istio.io" || g == "apiextensions.k8s.io"
		})
		t.Run("without "+what, func(t *testing.T) {
			less := role.DeepCopy()
			less.Rules = append(less.Rules[:i:i], role.Rules[i+1:]...)
			if err := apply(t, cp, []object{{obj: less, kind: "ClusterRole", name: less.Name}}); err != nil {
				t.Fatal(err)
			}
			restore := func() {
				if err := apply(t, cp, []object{{obj: role, kind: "ClusterRole", name: role.Name}}); err != nil {
					t.Errorf("restore the ClusterRole: %v", err)
				}
			}
			t.Cleanup(restore)
			a := startAgent(t, kubeconfig, up.Addr)
			if optional {
				checkDegraded(t, a, what, rule.Resources, web.Spec.ClusterIP)
				restore()
				if !testenv.WaitFor(30*time.Second, func() bool { return a.lookup("api.example.com.") == "192.0.2.10" }) {
					t.Fatalf("the rule for %s granted again: the ServiceEntry is still not answered\n%s", what, a.Log.String())
				}
				if m := a.metrics(t); m[`meshdns_names_source_stale_seconds{source="serviceentries"}`] != 0 {
					t.Errorf("recovered, but stale_seconds{serviceentries} = %v", m[`meshdns_names_source_stale_seconds{source="serviceentries"}`])
				}
				return
			}
			var body string
			ok := testenv.WaitFor(20*time.Second, func() bool {
				var code int
				code, body = a.readyz()
				return code == http.StatusServiceUnavailable && strings.Contains(body, "forbidden") &&
					mentionsAny(body, rule.Resources)
			})
			if !ok {
				code, body := a.readyz()
				t.Fatalf("without the rule for %s: /readyz %d %q, want 503 naming it as forbidden\n%s", what, code, body, a.Log.String())
			}
			t.Logf("without %s: %s", what, body)
			if ctx.Err() != nil {
				t.Fatal(ctx.Err())
			}
		})
	}
}

// checkDegraded: the agent is ready and answers the local cluster while the
// optional ServiceEntry source is forbidden, and says so in its metrics and log.
func checkDegraded(t *testing.T, a *agentRun, what string, resources []string, webIP string) {
	t.Helper()
	stale := `meshdns_names_source_stale_seconds{source="serviceentries"}`
	if !testenv.WaitFor(30*time.Second, func() bool {
		code, _ := a.readyz()
		return code == http.StatusOK && a.lookup("web.default.svc.cluster.local.") == webIP && a.metrics(t)[stale] > 0
	}) {
		code, body := a.readyz()
		t.Fatalf("without the rule for %s (an optional source): /readyz %d %q, %s = %v; want 200, the local Services answered and the source stale\n%s",
			what, code, body, stale, a.metrics(t)[stale], a.Log.String())
	}
	if a.lookup("api.example.com.") != "" {
		t.Errorf("without the rule for %s, api.example.com is answered", what)
	}
	if m := a.metrics(t); m[`meshdns_names_source_synced{source="serviceentries"}`] != 0 || m[`meshdns_names_source_errors_total{source="serviceentries"}`] == 0 {
		t.Errorf("serviceentries: synced %v, errors %v; want 0 and > 0", m[`meshdns_names_source_synced{source="serviceentries"}`], m[`meshdns_names_source_errors_total{source="serviceentries"}`])
	}
	if log := a.Log.String(); !strings.Contains(log, "forbidden") || !mentionsAny(log, resources) {
		t.Errorf("the log does not say %s is forbidden:\n%s", what, log)
	}
}

// createServiceEntry creates a ServiceEntry of one host with one address.
func createServiceEntry(t *testing.T, cp *kubetest.ControlPlane, ns, name, host, addr string) {
	t.Helper()
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": kubetest.ServiceEntryGVR.GroupVersion().String(),
		"kind":       "ServiceEntry",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{"hosts": []any{host}, "addresses": []any{addr}, "resolution": "STATIC",
			"ports": []any{map[string]any{"number": int64(443), "name": "https", "protocol": "TLS"}}},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := cp.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace(ns).Create(ctx, u, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// metrics scrapes the agent's /metrics: "name{labels}" (as exposed) -> value.
func (a *agentRun) metrics(t *testing.T) map[string]float64 {
	t.Helper()
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + a.admin + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

func mentionsAny(s string, words []string) bool {
	for _, w := range words {
		if strings.Contains(s, w) {
			return true
		}
	}
	return false
}

// The shipped roles let the agent tell an uninstall from a restart
// (kubelife): with the token of the shipped ServiceAccount it watches its
// namespace and DaemonSet, and a SIGTERM after `kubectl delete -k` (every
// object of the install deleted in the rendered order: the namespace first,
// the roles and service account before the DaemonSet) is an uninstall, while
// before it, it is a restart. Without either lifecycle role the agent says
// what it cannot watch, and takes a SIGTERM for a restart (it keeps its pins).
func TestShippedRolesTellUninstallFromRestart(t *testing.T) {
	testenv.RequirePrivileged(t)
	cp := kubetest.Start(t, kubetest.Options{})
	objs := render(t)
	if err := apply(t, cp, objs); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	ds, err := cp.AdminClient().AppsV1().DaemonSets("meshdns-system").Get(ctx, "meshdns-ebpf", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ref := metav1.NewControllerRef(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))
	cp.CreatePod(t, kubetest.Pod{Namespace: "meshdns-system", Name: "meshdns-ebpf-x1", Node: "node-a", Controller: ref})
	kubeconfig := cp.ServiceAccountKubeconfig(t, "meshdns-system", "meshdns-ebpf")
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	watchAs := func(t *testing.T) (*kubelife.Watch, *testenv.SyncBuffer) {
		t.Helper()
		log := &testenv.SyncBuffer{}
		w, err := kubelife.New(kubelife.Config{Rest: rc, Self: kubelife.Self{Namespace: "meshdns-system", Pod: "meshdns-ebpf-x1"},
			Node: "node-a", Logger: slog.New(slog.NewTextHandler(log, nil))})
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Start(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		return w, log
	}
	// The agent's namespace is readable through the lifecycle ClusterRole and through
	// the main one's namespaces rule (every namespace's budget annotations): without
	// it means without the lifecycle binding and that rule.
	for _, tc := range []struct {
		name        string
		noNamespace bool // the main ClusterRole without its namespaces rule too
	}{
		{"ClusterRoleBinding/meshdns-ebpf-lifecycle", true},
		{"RoleBinding/meshdns-ebpf-lifecycle", false},
	} {
		name := tc.name
		t.Run("without "+name, func(t *testing.T) {
			var binding []object
			for _, o := range objs {
				if o.kind+"/"+o.name == name {
					binding = append(binding, o)
				}
			}
			if err := deleteAll(t, cp, binding); err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := apply(t, cp, binding); err != nil {
					t.Errorf("restore %s: %v", name, err)
				}
			}()
			if tc.noNamespace {
				role := find[*rbacv1.ClusterRole](t, objs, "ClusterRole", "meshdns-ebpf")
				less := role.DeepCopy()
				less.Rules = slices.DeleteFunc(less.Rules, func(r rbacv1.PolicyRule) bool { return slices.Contains(r.Resources, "namespaces") })
				if len(less.Rules) != len(role.Rules)-1 {
					t.Fatalf("ClusterRole meshdns-ebpf: want one namespaces rule in %v", role.Rules)
				}
				if err := apply(t, cp, []object{{obj: less, kind: "ClusterRole", name: less.Name}}); err != nil {
					t.Fatal(err)
				}
				defer func() {
					if err := apply(t, cp, []object{{obj: role, kind: "ClusterRole", name: role.Name}}); err != nil {
						t.Errorf("restore the ClusterRole: %v", err)
					}
				}()
			}
			w, log := watchAs(t)
			if !testenv.WaitFor(30*time.Second, func() bool { return strings.Contains(log.String(), "cannot watch the agent's own") }) {
				t.Errorf("without %s the agent did not say what it cannot watch:\n%s", name, log.String())
			}
			if v := w.Verdict(ctx, time.Second); v.Uninstall || v.Successor != "" {
				t.Errorf("without %s: %+v, want a restart", name, v)
			}
			t.Logf("without %s: %s", name, strings.TrimSpace(log.String()))
		})
	}

	w, log := watchAs(t)
	if v := w.Verdict(ctx, 2*time.Second); v.Uninstall || v.Successor != "" {
		t.Fatalf("installed: %+v, want a restart", v)
	}
	if strings.Contains(log.String(), "cannot watch") {
		t.Errorf("with the shipped roles the agent cannot watch everything:\n%s", log.String())
	}
	if err := deleteAll(t, cp, objs); err != nil {
		t.Fatal(err)
	}
	if v := w.Verdict(ctx, 5*time.Second); !v.Uninstall {
		t.Errorf("after kubectl delete -k: %+v, want an uninstall", v)
	} else {
		t.Logf("after kubectl delete -k: %s", v.Reason)
	}
}
