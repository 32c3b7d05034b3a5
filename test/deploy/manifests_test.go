package deploy

import (
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// render renders the default install plus components and decodes it strictly.
func render(t *testing.T, components ...string) []object {
	t.Helper()
	var out []byte
	var err error
	if len(components) == 0 {
		out, err = kustomize(manifestsDir())
	} else {
		out, err = kustomizeWith(t.TempDir(), components...)
	}
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decodeStrict(out)
	if err != nil {
		t.Fatalf("strict decode of the rendered manifests: %v\n%s", err, out)
	}
	return objs
}

// renderChecked renders and fails on any policy violation.
func renderChecked(t *testing.T, components ...string) []object {
	t.Helper()
	objs := render(t, components...)
	if v := checkPolicy(objs); len(v) > 0 {
		t.Fatalf("policy violations:\n%s", strings.Join(v, "\n"))
	}
	return objs
}

func find[T any](t *testing.T, objs []object, kind, name string) T {
	t.Helper()
	for _, o := range objs {
		if o.kind == kind && o.name == name {
			v, ok := o.obj.(T)
			if !ok {
				t.Fatalf("%s/%s decoded as %T", kind, name, o.obj)
			}
			return v
		}
	}
	t.Fatalf("no %s/%s in the rendered manifests", kind, name)
	var zero T
	return zero
}

func kinds(objs []object) []string {
	var ks []string
	for _, o := range objs {
		ks = append(ks, o.kind+"/"+o.name)
	}
	sort.Strings(ks)
	return ks
}

func agent(t *testing.T, objs []object) corev1.Container {
	t.Helper()
	ds := find[*appsv1.DaemonSet](t, objs, "DaemonSet", "meshdns-ebpf")
	if n := len(ds.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("DaemonSet has %d containers, want 1", n)
	}
	return ds.Spec.Template.Spec.Containers[0]
}

func envValue(c corev1.Container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	return ""
}

// ruleSet flattens rules to "group/resource[names]: verbs" lines for exact comparison.
func ruleSet(rules []rbacv1.PolicyRule) []string {
	var out []string
	for _, r := range rules {
		verbs := slices.Clone(r.Verbs)
		sort.Strings(verbs)
		for _, g := range r.APIGroups {
			for _, res := range r.Resources {
				out = append(out, g+"/"+res+"["+strings.Join(r.ResourceNames, ",")+"]: "+strings.Join(verbs, ","))
			}
		}
	}
	sort.Strings(out)
	return out
}

func TestKustomizationListsEveryManifest(t *testing.T) {
	var k struct {
		Resources []string `json:"resources"`
	}
	b, err := os.ReadFile(filepath.Join(manifestsDir(), "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(b, &k, yaml.DisallowUnknownFields); err != nil {
		// Only resources matters here; the full file is checked by kustomize.
		if err := yaml.Unmarshal(b, &k); err != nil {
			t.Fatal(err)
		}
	}
	files, _ := filepath.Glob(filepath.Join(manifestsDir(), "*.yaml"))
	for _, f := range files {
		if base := filepath.Base(f); base != "kustomization.yaml" && !slices.Contains(k.Resources, base) {
			t.Errorf("%s is not listed in kustomization.yaml: `kubectl apply -k` would not apply it", base)
		}
	}
}

// Every source file decodes strictly on its own, before kustomize reformats it
// (a duplicated key would otherwise be silently dropped).
func TestManifestSourcesDecodeStrictly(t *testing.T) {
	var files []string
	for _, pat := range []string{"*.yaml", "components/*/*.yaml"} {
		m, _ := filepath.Glob(filepath.Join(manifestsDir(), pat))
		files = append(files, m...)
	}
	n := 0
	for _, f := range files {
		if filepath.Base(f) == "kustomization.yaml" {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		objs, err := decodeStrict(b)
		if err != nil {
			t.Errorf("%s: %v", f, err)
		}
		n += len(objs)
	}
	if n < 6 {
		t.Fatalf("decoded only %d objects from %d files", n, len(files))
	}
}

func TestDefaultInstall(t *testing.T) {
	objs := renderChecked(t)
	want := []string{"ClusterRole/meshdns-ebpf", "ClusterRole/meshdns-ebpf-egress", "ClusterRole/meshdns-ebpf-lifecycle",
		"ClusterRoleBinding/meshdns-ebpf", "ClusterRoleBinding/meshdns-ebpf-egress",
		"ClusterRoleBinding/meshdns-ebpf-lifecycle", "CustomResourceDefinition/dnsegresspolicies.meshdns.io",
		"DaemonSet/meshdns-ebpf", "Namespace/meshdns-system",
		"ResourceQuota/meshdns-ebpf-critical-pods", "Role/meshdns-ebpf-lifecycle", "RoleBinding/meshdns-ebpf-lifecycle",
		"ServiceAccount/meshdns-ebpf"}
	if got := kinds(objs); !slices.Equal(got, want) {
		t.Errorf("objects:\n got %v\nwant %v", got, want)
	}

	cr := find[*rbacv1.ClusterRole](t, objs, "ClusterRole", "meshdns-ebpf")
	wantRules := []string{
		"/namespaces[]: get,list,watch",
		"/pods[]: get,list,watch",
		"/services[]: get,list,watch",
		"apiextensions.k8s.io/customresourcedefinitions[serviceentries.networking.istio.io]: get,list,watch",
		"discovery.k8s.io/endpointslices[]: get,list,watch",
		"networking.istio.io/serviceentries[]: get,list,watch",
	}
	if got := ruleSet(cr.Rules); !slices.Equal(got, wantRules) {
		t.Errorf("ClusterRole rules:\n got %q\nwant %q", got, wantRules)
	}
	egress := find[*rbacv1.ClusterRole](t, objs, "ClusterRole", "meshdns-ebpf-egress")
	wantEgress := []string{"/configmaps[istio]: get,list,watch", "/events[]: create", "meshdns.io/dnsegresspolicies/status[]: patch",
		"meshdns.io/dnsegresspolicies[]: get,list,watch", "networking.istio.io/sidecars[]: get,list,watch"}
	if got := ruleSet(egress.Rules); !slices.Equal(got, wantEgress) {
		t.Errorf("ClusterRole meshdns-ebpf-egress rules:\n got %q\nwant %q", got, wantEgress)
	}
	crb := find[*rbacv1.ClusterRoleBinding](t, objs, "ClusterRoleBinding", "meshdns-ebpf")
	if crb.RoleRef.Name != "meshdns-ebpf" || len(crb.Subjects) != 1 || crb.Subjects[0].Kind != "ServiceAccount" ||
		crb.Subjects[0].Name != "meshdns-ebpf" || crb.Subjects[0].Namespace != "meshdns-system" {
		t.Errorf("ClusterRoleBinding binds %v to %+v", crb.RoleRef, crb.Subjects)
	}
	ns := find[*corev1.Namespace](t, objs, "Namespace", "meshdns-system")
	if ns.Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("namespace labels %v: the agent needs the privileged Pod Security level", ns.Labels)
	}

	ds := find[*appsv1.DaemonSet](t, objs, "DaemonSet", "meshdns-ebpf")
	if ds.Spec.Template.Spec.ServiceAccountName != "meshdns-ebpf" {
		t.Errorf("serviceAccountName %q", ds.Spec.Template.Spec.ServiceAccountName)
	}
	c := agent(t, objs)
	if c.Image != "localhost/meshdns-ebpf:dev" {
		t.Errorf("image %q: kustomization's images entry not applied", c.Image)
	}
	if got := envValue(c, "MESHDNS_MODE"); got != "auto" || !slices.Contains(c.Args, "--mode=$(MESHDNS_MODE)") {
		t.Errorf("mode: env %q, args %v", got, c.Args)
	}
	if !slices.Equal(c.SecurityContext.Capabilities.Add, allowedCaps) {
		t.Errorf("auto mode capabilities %v, want %v", c.SecurityContext.Capabilities.Add, allowedCaps)
	}
	if !slices.Contains(c.Args, "--admin=$(NODE_IP):9153") {
		t.Errorf("args %v: the admin server must listen on the node IP", c.Args)
	}
	ann := ds.Spec.Template.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != "9153" {
		t.Errorf("pod annotations %v: Prometheus' pod discovery needs scrape and port", ann)
	}
	var paths []string
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			paths = append(paths, v.HostPath.Path)
		}
	}
	sort.Strings(paths)
	if want := []string{"/run/meshdns", "/run/xtables.lock", "/sys/fs/bpf", "/sys/fs/cgroup"}; !slices.Equal(paths, want) {
		t.Errorf("host paths %v, want %v", paths, want)
	}
}

func TestComponents(t *testing.T) {
	t.Run("ebpf-only", func(t *testing.T) {
		objs := renderChecked(t, "ebpf-only")
		c := agent(t, objs)
		if got := envValue(c, "MESHDNS_MODE"); got != "ebpf" {
			t.Errorf("MESHDNS_MODE %q, want ebpf", got)
		}
		if want := []corev1.Capability{"BPF", "NET_ADMIN", "NET_BIND_SERVICE", "SYS_NICE"}; !slices.Equal(c.SecurityContext.Capabilities.Add, want) {
			t.Errorf("capabilities %v, want %v", c.SecurityContext.Capabilities.Add, want)
		}
		ds := find[*appsv1.DaemonSet](t, objs, "DaemonSet", "meshdns-ebpf")
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == "xtables-lock" {
				t.Error("xtables-lock volume still present")
			}
		}
		for _, m := range c.VolumeMounts {
			if m.MountPath == "/run/xtables.lock" {
				t.Error("xtables lock still mounted")
			}
		}
		if len(c.VolumeMounts) != 3 {
			t.Errorf("mounts %v", c.VolumeMounts)
		}
	})
	t.Run("egress", func(t *testing.T) {
		// --egress, and --egress-internal-cidrs from the env value an overlay sets
		// (empty: no internal prefixes), as the chart's egress values render them.
		c := agent(t, renderChecked(t, "egress"))
		n := len(c.Args)
		if n < 2 || c.Args[n-2] != "--egress" || c.Args[n-1] != "--egress-internal-cidrs=$(MESHDNS_EGRESS_INTERNAL_CIDRS)" {
			t.Errorf("args %v: want --egress and --egress-internal-cidrs=$(MESHDNS_EGRESS_INTERNAL_CIDRS) last", c.Args)
		}
		if i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "MESHDNS_EGRESS_INTERNAL_CIDRS" }); i < 0 || c.Env[i].Value != "" {
			t.Errorf("env %v: want MESHDNS_EGRESS_INTERNAL_CIDRS, empty", c.Env)
		}
	})
	t.Run("istio-remote-secrets", func(t *testing.T) {
		objs := renderChecked(t, "istio-remote-secrets")
		role := find[*rbacv1.Role](t, objs, "Role", "meshdns-ebpf-remote-secrets")
		if got, want := ruleSet(role.Rules), []string{"/secrets[]: get,list,watch"}; !slices.Equal(got, want) || role.Namespace != "meshdns-system" {
			t.Errorf("Role %s rules %q", role.Namespace, got)
		}
		rb := find[*rbacv1.RoleBinding](t, objs, "RoleBinding", "meshdns-ebpf-remote-secrets")
		if rb.RoleRef.Kind != "Role" || rb.Subjects[0].Name != "meshdns-ebpf" || rb.Namespace != "meshdns-system" {
			t.Errorf("RoleBinding %+v", rb)
		}
		if c := agent(t, objs); c.Args[len(c.Args)-1] != "--istio-remote-secrets" {
			t.Errorf("args %v", c.Args)
		}
	})
	t.Run("prometheus-operator", func(t *testing.T) {
		objs := renderChecked(t, "prometheus-operator")
		svc := find[*corev1.Service](t, objs, "Service", "meshdns-ebpf-metrics")
		ds := find[*appsv1.DaemonSet](t, objs, "DaemonSet", "meshdns-ebpf")
		if svc.Spec.ClusterIP != corev1.ClusterIPNone || len(svc.Spec.Ports) != 1 ||
			svc.Spec.Ports[0].TargetPort != intstr.FromInt32(9153) {
			t.Errorf("metrics Service %+v: want headless, port 9153 by number (no named container port exists)", svc.Spec)
		}
		for k, v := range svc.Spec.Selector {
			if ds.Spec.Template.Labels[k] != v {
				t.Errorf("Service selector %v does not select the agent's pods %v", svc.Spec.Selector, ds.Spec.Template.Labels)
			}
		}
		for k := range ds.Spec.Template.Annotations {
			if strings.HasPrefix(k, "prometheus.io/") {
				t.Errorf("pod annotation %s: the agents would be scraped twice", k)
			}
		}
		if ds.Spec.Template.Annotations[apparmorAnnotation+"agent"] != "unconfined" {
			t.Errorf("pod annotations %v: the AppArmor one was removed with the scrape ones", ds.Spec.Template.Annotations)
		}
		sm := find[*unstructured.Unstructured](t, objs, "ServiceMonitor", "meshdns-ebpf")
		sel, _, _ := unstructured.NestedStringMap(sm.Object, "spec", "selector", "matchLabels")
		for k, v := range sel {
			if svc.Labels[k] != v {
				t.Errorf("ServiceMonitor selector %v does not select the Service's labels %v", sel, svc.Labels)
			}
		}
		eps, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
		if len(eps) != 1 || eps[0].(map[string]any)["port"] != svc.Spec.Ports[0].Name {
			t.Errorf("ServiceMonitor endpoints %v, want the Service's port %q", eps, svc.Spec.Ports[0].Name)
		}
	})
	t.Run("names-configmap", func(t *testing.T) {
		objs := renderChecked(t, "names-configmap")
		find[*corev1.ConfigMap](t, objs, "ConfigMap", "meshdns-names")
		c := agent(t, objs)
		if !slices.Contains(c.Args, "--names=/etc/meshdns/names.yaml") || !slices.Contains(c.Args, "--kubernetes") {
			t.Errorf("args %v", c.Args)
		}
		if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/etc/meshdns" && m.ReadOnly }) {
			t.Errorf("mounts %v", c.VolumeMounts)
		}
	})
	t.Run("all", func(t *testing.T) {
		renderChecked(t, "ebpf-only", "istio-remote-secrets", "prometheus-operator", "names-configmap", "prometheus-rules", "grafana-dashboard")
	})
}

// daemonSetViolation is one thing the policy check forbids in the DaemonSet:
// mutate brings it in, want is what the violation must mention.
type daemonSetViolation struct {
	name, want string
	mutate     func(*appsv1.DaemonSet)
}

// daemonSetViolations are what TestPolicyCatchesViolations brings into the
// rendered DaemonSet, one at a time.
var daemonSetViolations = []daemonSetViolation{
	{"SYS_ADMIN", "SYS_ADMIN", func(d *appsv1.DaemonSet) {
		c := &d.Spec.Template.Spec.Containers[0]
		c.SecurityContext.Capabilities.Add = append(c.SecurityContext.Capabilities.Add, "SYS_ADMIN")
	}},
	{"other capability", "PERFMON", func(d *appsv1.DaemonSet) {
		c := &d.Spec.Template.Spec.Containers[0]
		c.SecurityContext.Capabilities.Add = append(c.SecurityContext.Capabilities.Add, "PERFMON")
	}},
	{"no drop ALL", "drop ALL", func(d *appsv1.DaemonSet) { d.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Drop = nil }},
	{"privileged", "privileged", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.Privileged = ptr(true)
	}},
	{"hostPID", "hostPID", func(d *appsv1.DaemonSet) { d.Spec.Template.Spec.HostPID = true }},
	{"host /etc", "host path /etc", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Volumes = append(d.Spec.Template.Spec.Volumes, corev1.Volume{Name: "etc",
			VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/etc"}}})
	}},
	{"declared port", "declares ports", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 9153}}
	}},
	{"writable root", "readOnlyRootFilesystem", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.ReadOnlyRootFilesystem = nil
	}},
	{"escalation unset", "allowPrivilegeEscalation", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.AllowPrivilegeEscalation = nil
	}},
	{"escalation on", "allowPrivilegeEscalation", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.AllowPrivilegeEscalation = ptr(true)
	}},
	{"no seccomp", "seccompProfile", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.SeccompProfile = nil
		d.Spec.Template.Spec.SecurityContext = nil
	}},
	{"unconfined", "seccompProfile", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.SeccompProfile = &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeUnconfined}
	}},
	{"maxSurge 2", "maxSurge", func(d *appsv1.DaemonSet) {
		d.Spec.UpdateStrategy.RollingUpdate.MaxSurge = ptr(intstr.FromInt32(2))
	}},
	{"maxUnavailable 1", "maxUnavailable", func(d *appsv1.DaemonSet) {
		d.Spec.UpdateStrategy.RollingUpdate.MaxUnavailable = ptr(intstr.FromInt32(1))
	}},
	{"maxUnavailable percent", "maxUnavailable", func(d *appsv1.DaemonSet) {
		d.Spec.UpdateStrategy.RollingUpdate.MaxUnavailable = ptr(intstr.FromString("10%"))
	}},
	{"OnDelete", "RollingUpdate", func(d *appsv1.DaemonSet) {
		d.Spec.UpdateStrategy = appsv1.DaemonSetUpdateStrategy{Type: appsv1.OnDeleteDaemonSetStrategyType}
	}},
	{"loopback admin", "loopback admin", func(d *appsv1.DaemonSet) {
		c := &d.Spec.Template.Spec.Containers[0]
		c.Args = append(c.Args, "--admin=127.0.0.1:9153")
	}},
	{"HTTP readiness probe", "must be an exec probe", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].ReadinessProbe.ProbeHandler = corev1.ProbeHandler{
			HTTPGet: &corev1.HTTPGetAction{Path: "/readyz", Port: intstr.FromInt32(9153)},
		}
	}},
	{"readiness probe that checks liveness", "readinessProbe runs", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].ReadinessProbe.Exec.Command = []string{"/usr/local/bin/meshdns-ebpf", "probe", "live"}
	}},
	{"probe timeout of the default 1 s", "timeoutSeconds", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].LivenessProbe.TimeoutSeconds = 0
	}},
	{"grace period of 30 s", "terminationGracePeriodSeconds", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.TerminationGracePeriodSeconds = ptr(int64(30))
	}},
	{"cluster DNS for the agent", "dnsPolicy", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.DNSPolicy = corev1.DNSClusterFirstWithHostNet
	}},
	{"no memory limit", "memory limit", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].Resources.Limits = nil
	}},
	{"node name", "NODE_NAME", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].Env = nil
	}},
	{"any OS", "kubernetes.io/os", func(d *appsv1.DaemonSet) { d.Spec.Template.Spec.NodeSelector = nil }},
	{"any architecture", "architectures", func(d *appsv1.DaemonSet) { d.Spec.Template.Spec.Affinity = nil }},
	{"an architecture the image lacks", "architectures", func(d *appsv1.DaemonSet) {
		e := &d.Spec.Template.Spec.Affinity.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms[0].MatchExpressions[0]
		e.Values = append(e.Values, "s390x")
	}},
	{"AppArmor runtime default", "appArmorProfile", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.AppArmorProfile = &corev1.AppArmorProfile{Type: corev1.AppArmorProfileTypeRuntimeDefault}
	}},
	{"no AppArmor annotation", "annotation " + apparmorAnnotation, func(d *appsv1.DaemonSet) {
		delete(d.Spec.Template.Annotations, apparmorAnnotation+"agent")
	}},
	{"no SELinux type", "spc_t", func(d *appsv1.DaemonSet) {
		d.Spec.Template.Spec.Containers[0].SecurityContext.SELinuxOptions = nil
	}},
	{"hard-coded GOMEMLIMIT", "GOMEMLIMIT is set", func(d *appsv1.DaemonSet) {
		c := &d.Spec.Template.Spec.Containers[0]
		c.Env = append(c.Env, corev1.EnvVar{Name: "GOMEMLIMIT", Value: "230MiB"})
	}},
	{"memory limit not from the container", "MESHDNS_MEMORY_LIMIT", func(d *appsv1.DaemonSet) {
		c := &d.Spec.Template.Spec.Containers[0]
		for i := range c.Env {
			if c.Env[i].Name == "MESHDNS_MEMORY_LIMIT" {
				c.Env[i] = corev1.EnvVar{Name: "MESHDNS_MEMORY_LIMIT", Value: "268435456"}
			}
		}
	}},
}

// The policy check itself must fail on each thing it forbids.
func TestPolicyCatchesViolations(t *testing.T) {
	base := render(t)
	for _, tc := range daemonSetViolations {
		t.Run(tc.name, func(t *testing.T) {
			v := checkPolicy(mutated(base, func(o runtime.Object) runtime.Object {
				if ds, ok := o.(*appsv1.DaemonSet); ok {
					ds = ds.DeepCopy()
					tc.mutate(ds)
					return ds
				}
				return o
			}))
			if !slices.ContainsFunc(v, func(s string) bool { return strings.Contains(s, tc.want) }) {
				t.Fatalf("the policy check did not catch it (want a violation mentioning %q); got %q", tc.want, v)
			}
		})
	}
	t.Run("secrets cluster-wide", func(t *testing.T) {
		v := checkPolicy(mutated(base, func(o runtime.Object) runtime.Object {
			if cr, ok := o.(*rbacv1.ClusterRole); ok {
				cr = cr.DeepCopy()
				cr.Rules = append(cr.Rules, rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch", "create"}})
				return cr
			}
			return o
		}))
		for _, want := range []string{"secrets cluster-wide", `verb "create"`} {
			if !slices.ContainsFunc(v, func(s string) bool { return strings.Contains(s, want) }) {
				t.Errorf("no violation mentioning %q in %q", want, v)
			}
		}
	})
	// The allowed writes are exact: another verb on them, their verb on
	// another resource or subresource, or a rule mixing them with more
	// resources is caught.
	for name, rule := range map[string]rbacv1.PolicyRule{
		"events update":       {APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "update"}},
		"another status":      {APIGroups: []string{"networking.istio.io"}, Resources: []string{"serviceentries/status"}, Verbs: []string{"patch"}},
		"policy spec patch":   {APIGroups: []string{"meshdns.io"}, Resources: []string{"dnsegresspolicies"}, Verbs: []string{"patch"}},
		"mixed with services": {APIGroups: []string{""}, Resources: []string{"events", "services"}, Verbs: []string{"create"}},
	} {
		t.Run(name, func(t *testing.T) {
			v := checkPolicy(mutated(base, func(o runtime.Object) runtime.Object {
				if cr, ok := o.(*rbacv1.ClusterRole); ok && cr.Name == "meshdns-ebpf-egress" {
					cr = cr.DeepCopy()
					cr.Rules = append(cr.Rules, rule)
					return cr
				}
				return o
			}))
			if len(v) == 0 {
				t.Fatalf("the policy check did not catch %+v", rule)
			}
			t.Log(v)
		})
	}
}

// mutated copies objs with each object replaced by what change returns.
func mutated(objs []object, change func(runtime.Object) runtime.Object) []object {
	out := make([]object, 0, len(objs))
	for _, o := range objs {
		o.obj = change(o.obj)
		out = append(out, o)
	}
	return out
}

func ptr[T any](v T) *T { return &v }

// TestCapabilitiesAreWhatE2EGrants: the DaemonSet's container adds exactly the
// capabilities the end-to-end suites run the agent with in its --mode
// (testenv.ModeCaps), for the default install and each component that changes
// the mode, so every capability it asks for is proven needed and enough.
func TestCapabilitiesAreWhatE2EGrants(t *testing.T) {
	for _, tc := range []struct{ name, component string }{{"default", ""}, {"ebpf-only", "ebpf-only"}} {
		t.Run(tc.name, func(t *testing.T) {
			var objs []object
			if tc.component == "" {
				objs = renderChecked(t)
			} else {
				objs = renderChecked(t, tc.component)
			}
			c := agent(t, objs)
			mode := envValue(c, "MESHDNS_MODE")
			want, ok := testenv.ModeCaps[mode]
			if !ok {
				t.Fatalf("MESHDNS_MODE %q: no capability set for it in testenv.ModeCaps", mode)
			}
			var got []string
			for _, cp := range c.SecurityContext.Capabilities.Add {
				got = append(got, strings.ToLower(string(cp)))
			}
			want = slices.Clone(want)
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Errorf("--mode %s: DaemonSet adds %v, the e2e suite runs it with %v", mode, got, want)
			}
			if d := c.SecurityContext.Capabilities.Drop; !slices.Equal(d, []corev1.Capability{"ALL"}) {
				t.Errorf("drop %v, want [ALL]", d)
			}
		})
	}
}
