package deploy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// chartDir is the Helm chart, rendered from deploy/kubernetes (files/kubernetes links there).
func chartDir() string { return filepath.Join(repoRoot(), "charts", "meshdns-ebpf") }

// helmTemplate renders the chart with values (YAML) as `helm template` does.
func helmTemplate(t *testing.T, values string) ([]byte, error) {
	t.Helper()
	return runTool(t, nil, "helm", withValues(t, values, "template", "meshdns-ebpf", chartDir())...)
}

// withValues appends --values FILE for values (YAML) to args, unless empty.
func withValues(t *testing.T, values string, args ...string) []string {
	t.Helper()
	if values == "" {
		return args
	}
	f := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(f, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	return append(args, "--values", f)
}

// plainObjects decodes every document into its JSON form, keyed and sorted by
// kind/namespace/name: what `kubectl apply` would send, comments and order aside.
func plainObjects(t *testing.T, data []byte) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(bytes.TrimSpace(doc)) == 0 || isComment(doc) {
			continue
		}
		j, err := yaml.YAMLToJSONStrict(doc)
		if err != nil {
			t.Fatalf("%v\n%s", err, doc)
		}
		var m map[string]any
		if err := json.Unmarshal(j, &m); err != nil {
			t.Fatal(err)
		}
		u := unstructured.Unstructured{Object: m}
		key := u.GetKind() + "/" + u.GetNamespace() + "/" + u.GetName()
		if _, dup := out[key]; dup {
			t.Fatalf("%s twice", key)
		}
		out[key] = m
	}
}

// diffObjects describes how two object sets differ ("" when equal).
func diffObjects(got, want map[string]map[string]any) string {
	var b strings.Builder
	keys := map[string]bool{}
	for k := range got {
		keys[k] = true
	}
	for k := range want {
		keys[k] = true
	}
	var sorted []string
	for k := range keys {
		sorted = append(sorted, k)
	}
	slices.Sort(sorted)
	for _, k := range sorted {
		g, w := got[k], want[k]
		switch {
		case g == nil:
			fmt.Fprintf(&b, "only in kustomize: %s\n", k)
		case w == nil:
			fmt.Fprintf(&b, "only in the chart: %s\n", k)
		case !reflect.DeepEqual(g, w):
			gj, _ := yaml.Marshal(g)
			wj, _ := yaml.Marshal(w)
			fmt.Fprintf(&b, "%s differs:\n--- chart\n%s--- kustomize\n%s", k, gj, wj)
		}
	}
	return b.String()
}

// The chart with default values is `kubectl kustomize deploy/kubernetes`, object for
// object; with its monitoring values on, it is the base plus the matching component.
func TestChartEqualsKustomize(t *testing.T) {
	for _, tc := range []struct {
		name, values string
		components   []string
	}{
		{"defaults", "", nil},
		{"serviceMonitor", "serviceMonitor: {enabled: true}", []string{"prometheus-operator"}},
		{"prometheusRule", "prometheusRule: {enabled: true}", []string{"prometheus-rules"}},
		{"dashboard", "dashboard: {enabled: true}", []string{"grafana-dashboard"}},
		{"all monitoring", "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}",
			[]string{"prometheus-operator", "prometheus-rules", "grafana-dashboard"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			chart, err := helmTemplate(t, tc.values)
			if err != nil {
				t.Fatal(err)
			}
			var kz []byte
			if tc.components == nil {
				kz, err = kustomize(manifestsDir())
			} else {
				kz, err = kustomizeWith(t.TempDir(), tc.components...)
			}
			if err != nil {
				t.Fatal(err)
			}
			got, want := plainObjects(t, chart), plainObjects(t, kz)
			if d := diffObjects(got, want); d != "" {
				t.Fatalf("helm template and kustomize differ:\n%s", d)
			}
			t.Logf("%d objects, equal", len(got))
		})
	}
}

// The chart reads deploy/kubernetes itself, so a change there (another engineer's
// probe change, say) reaches the chart with no edit of it; `helm package` copies
// what it reads.
func TestChartFollowsTheManifests(t *testing.T) {
	link, err := os.Readlink(filepath.Join(chartDir(), "files", "kubernetes"))
	if err != nil {
		t.Fatalf("charts/meshdns-ebpf/files/kubernetes must be a symlink to deploy/kubernetes: %v", err)
	}
	if got, _ := filepath.Abs(filepath.Join(chartDir(), "files", link)); got != manifestsDir() {
		t.Fatalf("files/kubernetes points to %s, want %s", got, manifestsDir())
	}
	// A packaged chart carries the linked files: it renders the same objects.
	dir := t.TempDir()
	if _, err := runTool(t, nil, "helm", "package", chartDir(), "-d", dir); err != nil {
		t.Fatal(err)
	}
	pkgs, _ := filepath.Glob(filepath.Join(dir, "meshdns-ebpf-*.tgz"))
	if len(pkgs) != 1 {
		t.Fatalf("helm package made %v", pkgs)
	}
	const all = "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}"
	fromPkg, err := runTool(t, nil, "helm", withValues(t, all, "template", "meshdns-ebpf", pkgs[0])...)
	if err != nil {
		t.Fatal(err)
	}
	fromDir, err := helmTemplate(t, all)
	if err != nil {
		t.Fatal(err)
	}
	if d := diffObjects(plainObjects(t, fromPkg), plainObjects(t, fromDir)); d != "" {
		t.Fatalf("the packaged chart renders differently:\n%s", d)
	}
}

// Each value changes what its comment says, and the result still passes the
// manifest policy where the value keeps to it.
func TestChartValues(t *testing.T) {
	const values = `
image: {repository: registry.example.com/team/meshdns-ebpf, tag: v1.2.3, digest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", pullPolicy: Always, architectures: [amd64, arm64]}
extraArgs: [--cache-bytes=67108864]
resources: {limits: {memory: 384Mi}}
nodeSelector: {node-role.example.com/dns: "true"}
tolerations: [{key: dedicated, operator: Equal, value: dns, effect: NoSchedule}]
priorityClassName: meshdns-critical
appArmorProfile: {type: Localhost, localhostProfile: meshdns}
seLinuxOptions: {type: spc_t, level: s0}
serviceMonitor: {enabled: true, labels: {release: prom}}
prometheusRule: {enabled: true, labels: {release: prom}, thresholds: {MeshDNSNameSourceStale: 600, MeshDNSOverloadShedding: 0.05}, for: {MeshDNSAgentNotReady: 10m}, severity: {MeshDNSCacheAtCap: warning}}
dashboard: {enabled: true, labels: {team: dns}}
`
	out, err := helmTemplate(t, values)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decodeStrict(out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	ds := find[*appsv1.DaemonSet](t, objs, "DaemonSet", "meshdns-ebpf")
	c := agent(t, objs)
	p := ds.Spec.Template.Spec
	checks := []struct {
		what string
		ok   bool
	}{
		{"image", c.Image == "registry.example.com/team/meshdns-ebpf:v1.2.3@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"},
		{"pull policy", c.ImagePullPolicy == corev1.PullAlways},
		{"extra args after the base's", c.Args[len(c.Args)-1] == "--cache-bytes=67108864" && slices.Contains(c.Args, "--kubernetes")},
		{"memory limit merged, request kept", c.Resources.Limits.Memory().String() == "384Mi" && c.Resources.Requests.Memory().String() == "96Mi"},
		{"nodeSelector merged", p.NodeSelector["kubernetes.io/os"] == "linux" && p.NodeSelector["node-role.example.com/dns"] == "true"},
		{"architectures", slices.Equal(p.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions[0].Values, []string{"amd64", "arm64"})},
		{"tolerations replaced", len(p.Tolerations) == 1 && p.Tolerations[0].Key == "dedicated"},
		{"priority class", p.PriorityClassName == "meshdns-critical"},
		{"AppArmor field", c.SecurityContext.AppArmorProfile.Type == corev1.AppArmorProfileTypeLocalhost && *c.SecurityContext.AppArmorProfile.LocalhostProfile == "meshdns"},
		{"AppArmor annotation follows", ds.Spec.Template.Annotations[apparmorAnnotation+"agent"] == "localhost/meshdns"},
		{"SELinux", c.SecurityContext.SELinuxOptions.Level == "s0"},
		{"no scrape annotations with a ServiceMonitor", ds.Spec.Template.Annotations["prometheus.io/scrape"] == ""},
	}
	sm := find[*unstructured.Unstructured](t, objs, "ServiceMonitor", "meshdns-ebpf")
	checks = append(checks, struct {
		what string
		ok   bool
	}{"ServiceMonitor labels", sm.GetLabels()["release"] == "prom" && sm.GetLabels()["app.kubernetes.io/name"] == "meshdns-ebpf"})
	pr := find[*unstructured.Unstructured](t, objs, "PrometheusRule", "meshdns-ebpf")
	rules := alertRules(t, pr)
	checks = append(checks, []struct {
		what string
		ok   bool
	}{
		{"PrometheusRule labels", pr.GetLabels()["release"] == "prom"},
		{"threshold 600", strings.HasSuffix(rules["MeshDNSNameSourceStale"]["expr"].(string), "> 600")},
		{"threshold 0.05", strings.HasSuffix(strings.TrimSpace(rules["MeshDNSOverloadShedding"]["expr"].(string)), "> 0.05")},
		{"for", rules["MeshDNSAgentNotReady"]["for"] == "10m"},
		{"severity", rules["MeshDNSCacheAtCap"]["labels"].(map[string]any)["severity"] == "warning"},
	}...)
	cm := find[*corev1.ConfigMap](t, objs, "ConfigMap", "meshdns-ebpf-dashboard")
	checks = append(checks, struct {
		what string
		ok   bool
	}{"dashboard labels", cm.Labels["team"] == "dns" && cm.Labels["grafana_dashboard"] == "1" && json.Valid([]byte(cm.Data["meshdns-ebpf.json"]))})
	for _, ch := range checks {
		if !ch.ok {
			t.Errorf("%s: not applied", ch.what)
		}
	}
	// Everything but the AppArmor profile (Localhost here) keeps to the policy.
	var v []string
	for _, s := range checkPolicy(objs) {
		if !strings.Contains(s, "appArmorProfile") && !strings.Contains(s, "annotation "+apparmorAnnotation) &&
			!strings.Contains(s, "architectures") && !strings.Contains(s, "priorityClassName") && !strings.Contains(s, "every taint") {
			v = append(v, s)
		}
	}
	if len(v) > 0 {
		t.Errorf("policy violations:\n%s", strings.Join(v, "\n"))
	}
	// Misspelled alert names and an AppArmor type Kubernetes lacks are refused.
	for _, bad := range []string{"prometheusRule: {enabled: true, thresholds: {MeshDNSNoSuchAlert: 1}}", "appArmorProfile: {type: Complain}"} {
		if _, err := helmTemplate(t, bad); err == nil {
			t.Errorf("values %q: rendered, want an error", bad)
		}
	}
}

// alertRules is the PrometheusRule's alerting rules by name.
func alertRules(t *testing.T, pr *unstructured.Unstructured) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	groups, _, _ := unstructured.NestedSlice(pr.Object, "spec", "groups")
	for _, g := range groups {
		for _, r := range g.(map[string]any)["rules"].([]any) {
			r := r.(map[string]any)
			if a, ok := r["alert"].(string); ok {
				out[a] = r
			}
		}
	}
	if len(out) == 0 {
		t.Fatal("the PrometheusRule has no alerts")
	}
	return out
}

func TestHelmLint(t *testing.T) {
	for _, values := range []string{"", "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}"} {
		args := withValues(t, values, "lint", "--strict", chartDir())
		out, err := runTool(t, nil, "helm", args...)
		if err != nil {
			t.Fatalf("helm %v: %v", args, err)
		}
		t.Logf("helm %v:\n%s", args, out)
	}
}

// The chart, every monitoring value on, is accepted by a real kube-apiserver
// (server-side apply: its admission and validation), with the operator's CRDs stood in.
func TestChartServerSideApply(t *testing.T) {
	testenv.RequirePrivileged(t)
	out, err := helmTemplate(t, "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}")
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decodeStrict(out)
	if err != nil {
		t.Fatal(err)
	}
	cp := kubetest.Start(t, kubetest.Options{})
	installCRD(t, cp, serviceMonitorCRD())
	installCRD(t, cp, prometheusRuleCRD())
	if err := apply(t, cp, objs); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d objects applied", len(objs))
}
