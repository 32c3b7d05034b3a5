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

// helmTemplate renders the chart with values (YAML) as `helm template` does, in
// the release namespace meshdns-system with the chart's Namespace object on: what
// `kubectl kustomize deploy/kubernetes` gives.
func helmTemplate(t *testing.T, values string) ([]byte, error) {
	t.Helper()
	return helmTemplateIn(t, "meshdns-system", "namespace: {create: true}\n"+values)
}

// helmTemplateIn renders the chart with values (YAML) into the release namespace ns.
func helmTemplateIn(t *testing.T, ns, values string) ([]byte, error) {
	t.Helper()
	return runTool(t, nil, "helm", withValues(t, values, "template", "meshdns-ebpf", chartDir(), "--namespace", ns)...)
}

// standardLabels are the labels the chart adds to every object, as charts do.
var standardLabels = []string{"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"}

// stripStandardLabels removes standardLabels from every object of a chart's
// plainObjects, failing for an object that lacks one.
func stripStandardLabels(t *testing.T, objs map[string]map[string]any) {
	t.Helper()
	for key, o := range objs {
		md, _ := o["metadata"].(map[string]any)
		labels, _ := md["labels"].(map[string]any)
		for _, l := range standardLabels {
			if _, ok := labels[l]; !ok {
				t.Errorf("%s: no label %s", key, l)
			}
			delete(labels, l)
		}
		if labels != nil && len(labels) == 0 {
			delete(md, "labels")
		}
	}
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

// The chart in meshdns-system with its Namespace is `kubectl kustomize
// deploy/kubernetes`, object for object (but the standard labels); each component
// value gives the base plus that component; and each value that changes the
// DaemonSet gives what a kustomize overlay with the same patch gives.
func TestChartEqualsKustomize(t *testing.T) {
	base, err := kustomize(manifestsDir())
	if err != nil {
		t.Fatal(err)
	}
	baseDS := find[*appsv1.DaemonSet](t, mustDecode(t, base), "DaemonSet", "meshdns-ebpf")
	adminArg := slices.IndexFunc(baseDS.Spec.Template.Spec.Containers[0].Args, func(a string) bool { return strings.HasPrefix(a, "--admin=") })
	cgroupVol := slices.IndexFunc(baseDS.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == "cgroup" })
	if adminArg < 0 || cgroupVol < 0 {
		t.Fatalf("the base DaemonSet has no --admin argument (%d) or cgroup volume (%d)", adminArg, cgroupVol)
	}
	const all = "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}\n" +
		"components: {ebpfOnly: true, istioRemoteSecrets: true, namesConfigMap: true}"
	dsPatch := func(ops string) string {
		return "patches:\n  - target: {kind: DaemonSet, name: meshdns-ebpf}\n    patch: |-\n" + ops
	}
	for _, tc := range []struct {
		name, values string
		components   []string
		overlay      string
	}{
		{"defaults", "", nil, ""},
		{"components.ebpfOnly", "components: {ebpfOnly: true}", []string{"ebpf-only"}, ""},
		{"components.istioRemoteSecrets", "components: {istioRemoteSecrets: true}", []string{"istio-remote-secrets"}, ""},
		{"components.namesConfigMap", "components: {namesConfigMap: true}", []string{"names-configmap"}, ""},
		{"egress.enabled", "egress: {enabled: true}", []string{"egress"}, ""},
		{"egress.internalCIDRs", "egress: {enabled: true, internalCIDRs: [10.244.0.0/16, 10.96.0.0/12]}", []string{"egress"},
			dsPatch(fmt.Sprintf("      - {op: replace, path: /spec/template/spec/containers/0/env/%d/value, value: \"10.244.0.0/16,10.96.0.0/12\"}",
				len(baseDS.Spec.Template.Spec.Containers[0].Env)))},
		{"serviceMonitor", "serviceMonitor: {enabled: true}", []string{"prometheus-operator"}, ""},
		{"prometheusRule", "prometheusRule: {enabled: true}", []string{"prometheus-rules"}, ""},
		{"dashboard", "dashboard: {enabled: true}", []string{"grafana-dashboard"}, ""},
		{"every component", all + "\negress: {enabled: true}",
			[]string{"ebpf-only", "istio-remote-secrets", "names-configmap", "egress", "prometheus-operator", "prometheus-rules", "grafana-dashboard"}, ""},
		{"imagePullSecrets", "imagePullSecrets: [{name: regcred}]", nil,
			dsPatch("      - {op: add, path: /spec/template/spec/imagePullSecrets, value: [{name: regcred}]}")},
		{"podLabels and podAnnotations", "podLabels: {team: dns}\npodAnnotations: {example.com/owner: dns}", nil,
			dsPatch("      - {op: add, path: /spec/template/metadata/labels/team, value: dns}\n" +
				"      - {op: add, path: /spec/template/metadata/annotations/example.com~1owner, value: dns}")},
		{"updateStrategy", `updateStrategy: {rollingUpdate: {maxSurge: "10%"}}`, nil,
			dsPatch(`      - {op: replace, path: /spec/updateStrategy/rollingUpdate/maxSurge, value: "10%"}`)},
		{"cgroupPath", "cgroupPath: /sys/fs/cgroup/unified", nil,
			dsPatch(fmt.Sprintf("      - {op: replace, path: /spec/template/spec/volumes/%d/hostPath/path, value: /sys/fs/cgroup/unified}", cgroupVol))},
		{"adminPort", "adminPort: 9253", nil,
			dsPatch(fmt.Sprintf("      - {op: replace, path: /spec/template/spec/containers/0/args/%d, value: \"--admin=$(NODE_IP):9253\"}\n", adminArg) +
				`      - {op: replace, path: /spec/template/metadata/annotations/prometheus.io~1port, value: "9253"}`)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			chart, err := helmTemplate(t, tc.values)
			if err != nil {
				t.Fatal(err)
			}
			var kz []byte
			if tc.components == nil && tc.overlay == "" {
				kz = base
			} else {
				kz, err = kustomizeOverlay(t.TempDir(), tc.overlay, tc.components...)
			}
			if err != nil {
				t.Fatal(err)
			}
			got, want := plainObjects(t, chart), plainObjects(t, kz)
			stripStandardLabels(t, got)
			if d := diffObjects(got, want); d != "" {
				t.Fatalf("helm template and kustomize differ:\n%s", d)
			}
			t.Logf("%d objects, equal", len(got))
		})
	}
}

// mustDecode decodes rendered manifests, failing the test on an error.
func mustDecode(t *testing.T, data []byte) []object {
	t.Helper()
	objs, err := decodeStrict(data)
	if err != nil {
		t.Fatal(err)
	}
	return objs
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
	const all = "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}\n" +
		"components: {ebpfOnly: true, istioRemoteSecrets: true, namesConfigMap: true}"
	fromPkg, err := runTool(t, nil, "helm", withValues(t, "namespace: {create: true}\n"+all, "template", "meshdns-ebpf", pkgs[0], "--namespace", "meshdns-system")...)
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
imagePullSecrets: [{name: regcred}]
extraArgs: [--cache-bytes=67108864]
adminPort: 9253
resources: {limits: {memory: 384Mi}}
nodeSelector: {node-role.example.com/dns: "true"}
tolerations: [{key: dedicated, operator: Equal, value: dns, effect: NoSchedule}]
priorityClassName: meshdns-critical
appArmorProfile: {type: Localhost, localhostProfile: meshdns}
seLinuxOptions: {type: spc_t, level: s0}
serviceMonitor: {enabled: true, labels: {release: prom}, interval: 15s, honorLabels: true, relabelings: [{targetLabel: cluster, replacement: east}], metricRelabelings: [{action: drop, sourceLabels: [__name__], regex: go_gc_.*}]}
prometheusRule: {enabled: true, labels: {release: prom}, thresholds: {MeshDNSNameSourceStale: 600, MeshDNSOverloadShedding: 0.05, MeshDNSWorkloadNXDOMAINStorm: 200}, for: {MeshDNSAgentNotReady: 15m}, severity: {MeshDNSCacheAtCap: warning}}
dashboard: {enabled: true, labels: {team: dns}, namespace: monitoring}
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
		{"pull secrets", len(p.ImagePullSecrets) == 1 && p.ImagePullSecrets[0].Name == "regcred"},
		{"admin port", slices.Contains(c.Args, "--admin=$(NODE_IP):9253")},
	}
	svc := find[*corev1.Service](t, objs, "Service", "meshdns-ebpf-metrics")
	checks = append(checks, struct {
		what string
		ok   bool
	}{"metrics Service port", svc.Spec.Ports[0].Port == 9253 && svc.Spec.Ports[0].TargetPort.IntValue() == 9253})
	sm := find[*unstructured.Unstructured](t, objs, "ServiceMonitor", "meshdns-ebpf")
	checks = append(checks, struct {
		what string
		ok   bool
	}{"ServiceMonitor labels", sm.GetLabels()["release"] == "prom" && sm.GetLabels()["app.kubernetes.io/name"] == "meshdns-ebpf"})
	eps, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
	ep := eps[0].(map[string]any)
	relabel, _ := ep["relabelings"].([]any)
	checks = append(checks, []struct {
		what string
		ok   bool
	}{
		{"ServiceMonitor interval", ep["interval"] == "15s"},
		{"ServiceMonitor honorLabels", ep["honorLabels"] == true},
		{"ServiceMonitor relabelings appended", len(relabel) == 2 && relabel[1].(map[string]any)["targetLabel"] == "cluster"},
		{"ServiceMonitor metricRelabelings", len(ep["metricRelabelings"].([]any)) == 1},
	}...)
	pr := find[*unstructured.Unstructured](t, objs, "PrometheusRule", "meshdns-ebpf")
	rules := alertRules(t, pr)
	checks = append(checks, []struct {
		what string
		ok   bool
	}{
		{"PrometheusRule labels", pr.GetLabels()["release"] == "prom"},
		{"threshold 600", strings.HasSuffix(rules["MeshDNSNameSourceStale"]["expr"].(string), "> 600")},
		{"threshold 0.05", strings.HasSuffix(strings.TrimSpace(rules["MeshDNSOverloadShedding"]["expr"].(string)), "> 0.05")},
		{"for", rules["MeshDNSAgentNotReady"]["for"] == "15m"},
		{"description states the new for", strings.Contains(description(rules["MeshDNSAgentNotReady"]), "for 15m") && !strings.Contains(description(rules["MeshDNSAgentNotReady"]), "for 5m")},
		{"description states the new threshold", strings.Contains(description(rules["MeshDNSWorkloadNXDOMAINStorm"]), "more than 200 NXDOMAIN") && strings.HasSuffix(rules["MeshDNSWorkloadNXDOMAINStorm"]["expr"].(string), "> 200")},
		{"description states the new share", strings.Contains(description(rules["MeshDNSOverloadShedding"]), "More than 0.05 of queries")},
		{"description states the new seconds", strings.Contains(description(rules["MeshDNSNameSourceStale"]), "more than 600 seconds")},
		{"severity", rules["MeshDNSCacheAtCap"]["labels"].(map[string]any)["severity"] == "warning"},
	}...)
	cm := find[*corev1.ConfigMap](t, objs, "ConfigMap", "meshdns-ebpf-dashboard")
	checks = append(checks, struct {
		what string
		ok   bool
	}{"dashboard labels and namespace", cm.Labels["team"] == "dns" && cm.Labels["grafana_dashboard"] == "1" && cm.Namespace == "monitoring" && json.Valid([]byte(cm.Data["meshdns-ebpf.json"]))})
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
	for _, bad := range []string{"prometheusRule: {enabled: true, thresholds: {MeshDNSNoSuchAlert: 1}}", "appArmorProfile: {type: Complain}",
		"prometheusRule: {enabled: true, thresholds: {MeshDNSAgentNotReady: 1}}"} {
		if _, err := helmTemplate(t, bad); err == nil {
			t.Errorf("values %q: rendered, want an error", bad)
		}
	}
}

// description is an alerting rule's description annotation.
func description(r map[string]any) string {
	d, _ := r["annotations"].(map[string]any)["description"].(string)
	return d
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

// values.schema.json rejects what the chart would otherwise ignore or misread: an
// unknown key (a typo) at any level and a value of the wrong type, with a schema
// error; and it accepts values.yaml, whose keys are exactly the schema's.
func TestChartSchema(t *testing.T) {
	for _, tc := range []struct{ values, want string }{
		{"serviceMonitor: {enable: true}", "enable"},
		{"imagePullSecret: [{name: regcred}]", "imagePullSecret"},
		{"image: {respository: registry.example.com/x}", "respository"},
		{"components: {ebpf-only: true}", "ebpf-only"},
		{"adminPort: \"9153\"", "adminPort"},
		{"tolerations: {operator: Exists}", "tolerations"},
		{"prometheusRule: {for: {MeshDNSAgentNotReady: 10}}", "MeshDNSAgentNotReady"},
		{"prometheusRule: {severity: {MeshDNSCacheAtCap: page}}", "MeshDNSCacheAtCap"},
		{"egress: {enable: true}", "enable"},
		{"egress: {enabled: true, internalCIDRs: 10.244.0.0/16}", "internalCIDRs"},
	} {
		out, err := helmTemplate(t, tc.values)
		if err == nil {
			t.Errorf("values %q: rendered, want a schema error\n%.300s", tc.values, out)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, "schema") || !strings.Contains(msg, tc.want) {
			t.Errorf("values %q: error does not name the schema and %q:\n%s", tc.values, tc.want, msg)
			continue
		}
		t.Logf("values %q: %s", tc.values, firstLine(msg, tc.want))
	}

	// values.yaml and the schema name the same keys.
	var schema struct {
		Properties map[string]json.RawMessage `json:"properties"`
	}
	b, err := os.ReadFile(filepath.Join(chartDir(), "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	vb, err := os.ReadFile(filepath.Join(chartDir(), "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values map[string]any
	if err := yaml.Unmarshal(vb, &values); err != nil {
		t.Fatal(err)
	}
	schemaKeys, valueKeys := schemaPaths(t, b), flatKeys("", values)
	for _, k := range valueKeys {
		if !slices.Contains(schemaKeys, k) {
			t.Errorf("values.yaml has %s, the schema does not", k)
		}
	}
	for _, k := range schemaKeys {
		if !slices.Contains(valueKeys, k) && k != "global" {
			t.Errorf("the schema has %s, values.yaml does not", k)
		}
	}
}

// firstLine is the first line of s that contains sub (s when none does).
func firstLine(s, sub string) string {
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			return strings.TrimSpace(l)
		}
	}
	return s
}

// schemaPaths lists the dotted paths of a JSON schema's properties, descending into
// objects that list theirs (additionalProperties false).
func schemaPaths(t *testing.T, schema []byte) []string {
	t.Helper()
	type node struct {
		Properties map[string]json.RawMessage `json:"properties"`
	}
	var walk func(prefix string, raw []byte) []string
	walk = func(prefix string, raw []byte) []string {
		var n node
		if err := json.Unmarshal(raw, &n); err != nil {
			t.Fatal(err)
		}
		var out []string
		for k, v := range n.Properties {
			p := prefix + k
			var child node
			_ = json.Unmarshal(v, &child)
			if len(child.Properties) > 0 {
				out = append(out, walk(p+".", v)...)
			} else {
				out = append(out, p)
			}
		}
		return out
	}
	out := walk("", schema)
	slices.Sort(out)
	return out
}

// flatKeys lists the dotted paths of values' leaves; a map is a leaf when empty.
func flatKeys(prefix string, values map[string]any) []string {
	var out []string
	for k, v := range values {
		if m, ok := v.(map[string]any); ok && len(m) > 0 {
			out = append(out, flatKeys(prefix+k+".", m)...)
		} else {
			out = append(out, prefix+k)
		}
	}
	slices.Sort(out)
	return out
}

// docs/kubernetes.md's Helm values table names every value of the schema, and only those.
func TestChartValuesDocumented(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartDir(), "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	keys := schemaPaths(t, b)
	doc, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	section := string(doc)
	start := strings.Index(section, "\n### Helm\n")
	if start < 0 {
		t.Fatal("docs/kubernetes.md has no ### Helm section")
	}
	section = section[start+1:]
	if end := strings.Index(section, "\n### "); end > 0 {
		section = section[:end]
	}
	documented := map[string]bool{}
	for _, l := range strings.Split(section, "\n") {
		if !strings.HasPrefix(l, "| `") {
			continue
		}
		cell := strings.Split(l, "|")[1]
		last := ""
		for _, f := range strings.Split(cell, ",") {
			f = strings.Trim(strings.TrimSpace(f), "`")
			if strings.HasPrefix(f, ".") && last != "" {
				f = last[:strings.LastIndex(last, ".")] + f
			}
			documented[f], last = true, f
		}
	}
	for _, k := range keys {
		if !documented[k] && k != "global" {
			t.Errorf("value %s is not in docs/kubernetes.md's Helm values table", k)
		}
	}
	for k := range documented {
		if !slices.Contains(keys, k) {
			t.Errorf("docs/kubernetes.md's Helm values table names %s, which the schema lacks", k)
		}
	}
	t.Logf("%d values, each documented", len(keys))
}

// The objects go to the release namespace: every namespaced object, the role
// bindings' subjects and the lifecycle role's namespace name. The Namespace object
// is rendered only with namespace.create, under the release namespace's name; the
// dashboard's ConfigMap can go elsewhere.
func TestChartNamespace(t *testing.T) {
	const all = "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}\n" +
		"components: {ebpfOnly: true, istioRemoteSecrets: true, namesConfigMap: true}\n"
	for _, tc := range []struct {
		name, values string
		namespace    bool
	}{
		{"default", all, false},
		{"namespace.create", all + "namespace: {create: true}", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := helmTemplateIn(t, "other", tc.values)
			if err != nil {
				t.Fatal(err)
			}
			if strings.Contains(string(out), "meshdns-system") {
				t.Errorf("the output names meshdns-system:\n%s", grepLines(string(out), "meshdns-system"))
			}
			objs := plainObjects(t, out)
			var namespaces []string
			for key, o := range objs {
				u := unstructured.Unstructured{Object: o}
				switch u.GetKind() {
				case "Namespace":
					namespaces = append(namespaces, u.GetName())
					if u.GetLabels()["pod-security.kubernetes.io/enforce"] != "privileged" {
						t.Errorf("%s: no Pod Security label", key)
					}
				case "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition": // cluster-scoped
				default:
					if u.GetNamespace() != "other" {
						t.Errorf("%s: namespace %q, want other", key, u.GetNamespace())
					}
				}
				subjects, _, _ := unstructured.NestedSlice(o, "subjects")
				for _, s := range subjects {
					if ns := s.(map[string]any)["namespace"]; ns != "other" {
						t.Errorf("%s: subject in %v, want other", key, ns)
					}
				}
			}
			if want := map[bool]int{false: 0, true: 1}[tc.namespace]; len(namespaces) != want || (want == 1 && namespaces[0] != "other") {
				t.Errorf("Namespace objects %v, want %d named other", namespaces, want)
			}
			t.Logf("%d objects, all in other (Namespace objects: %v)", len(objs), namespaces)
		})
	}
	out, err := helmTemplateIn(t, "other", "dashboard: {enabled: true, namespace: monitoring}")
	if err != nil {
		t.Fatal(err)
	}
	if cm := find[*corev1.ConfigMap](t, mustDecode(t, out), "ConfigMap", "meshdns-ebpf-dashboard"); cm.Namespace != "monitoring" {
		t.Errorf("dashboard ConfigMap in %q, want monitoring", cm.Namespace)
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// `tolerations: []` (and `affinity: {}`) keep the base's, so the agent still runs on
// every node; a list replaces them.
func TestChartEmptyTolerationsKeepTheBase(t *testing.T) {
	out, err := helmTemplate(t, "tolerations: []\naffinity: {}")
	if err != nil {
		t.Fatal(err)
	}
	p := find[*appsv1.DaemonSet](t, mustDecode(t, out), "DaemonSet", "meshdns-ebpf").Spec.Template.Spec
	if len(p.Tolerations) != 1 || p.Tolerations[0].Operator != corev1.TolerationOpExists || p.Affinity == nil {
		t.Fatalf("tolerations %v, affinity %v: want the base's (operator Exists; the architecture term)", p.Tolerations, p.Affinity)
	}
}

// An install's notes say what to set when the image is still the default, and
// name the release namespace.
func TestChartNotes(t *testing.T) {
	for _, tc := range []struct {
		values string
		warn   bool
	}{
		{"", true},
		{"image: {repository: registry.example.com/team/meshdns-ebpf, tag: v1}", false},
	} {
		out, err := runTool(t, nil, "helm", withValues(t, tc.values, "install", "meshdns-ebpf", chartDir(), "--namespace", "dns", "--dry-run=client")...)
		if err != nil {
			t.Fatal(err)
		}
		notes := string(out)
		if i := strings.Index(notes, "NOTES:"); i >= 0 {
			notes = notes[i:]
		} else {
			t.Fatalf("no NOTES in helm install --dry-run=client:\n%s", out)
		}
		if got := strings.Contains(notes, "image.repository is not set"); got != tc.warn {
			t.Errorf("values %q: image warning %v, want %v:\n%s", tc.values, got, tc.warn, notes)
		}
		if !strings.Contains(notes, "kubectl -n dns rollout status ds/meshdns-ebpf") {
			t.Errorf("values %q: the notes do not name the release namespace:\n%s", tc.values, notes)
		}
	}
}

func TestHelmLint(t *testing.T) {
	for _, values := range []string{"", "serviceMonitor: {enabled: true}\nprometheusRule: {enabled: true}\ndashboard: {enabled: true}\n" +
		"components: {ebpfOnly: true, istioRemoteSecrets: true, namesConfigMap: true}\nnamespace: {create: true}"} {
		args := withValues(t, values, "lint", "--strict", chartDir(), "--namespace", "other")
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
