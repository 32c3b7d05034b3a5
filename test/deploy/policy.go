package deploy

import (
	"fmt"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// The least-privilege contract of docs/kubernetes.md, checked on every rendered
// manifest set (the default install and each component).
var (
	// allowedHostPaths: the cgroup2 root (or its hybrid-host location), bpffs,
	// the agent's state dir, the xtables lock (iptables-legacy), and the node's
	// resolv.conf file for setups that mount it instead of using dnsPolicy Default.
	allowedHostPaths = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/bpf", "/run/meshdns", "/run/xtables.lock", "/etc/resolv.conf"}
	// allowedCaps: the union of what eBPF mode (BPF, NET_ADMIN, NET_BIND_SERVICE)
	// and iptables mode (NET_ADMIN, NET_RAW, NET_BIND_SERVICE) need, and
	// SYS_NICE for the resolver's reader threads' priority.
	allowedCaps = []corev1.Capability{"BPF", "NET_ADMIN", "NET_BIND_SERVICE", "NET_RAW", "SYS_NICE"}
	// The agent's memory must fit under the limit: its caches are sized for 256 MiB.
	minMemoryLimit = resource.MustParse("256Mi")
	readOnlyVerbs  = []string{"get", "list", "watch"}
	// allowedWrites are the agent's only writes, by "group/resource": the
	// status of DNSEgressPolicies and the Warning Event of a rejected one
	// (internal/kubeegress; every node computes the same and writes only
	// what is not there yet).
	allowedWrites = map[string][]string{
		"meshdns.io/dnsegresspolicies/status": {"patch"},
		"/events":                             {"create"},
	}
	// apparmorAnnotation is the pre-1.30 form of the agent container's
	// appArmorProfile field.
	apparmorAnnotation = "container.apparmor.security.beta.kubernetes.io/"
)

// checkPolicy returns every violation in objs; none is the pass.
func checkPolicy(objs []object) []string {
	var v []string
	bad := func(o object, format string, args ...any) {
		v = append(v, fmt.Sprintf("%s/%s: %s", o.kind, o.name, fmt.Sprintf(format, args...)))
	}
	daemonsets := 0
	for _, o := range objs {
		switch obj := o.obj.(type) {
		case *appsv1.DaemonSet:
			daemonsets++
			checkDaemonSet(obj, func(f string, a ...any) { bad(o, f, a...) })
		case *appsv1.Deployment, *appsv1.StatefulSet, *appsv1.ReplicaSet, *corev1.Pod:
			bad(o, "only the DaemonSet may run pods")
		case *rbacv1.ClusterRole:
			checkRules(obj.Rules, true, func(f string, a ...any) { bad(o, f, a...) })
		case *rbacv1.Role:
			if obj.Namespace != "meshdns-system" {
				bad(o, "a Role outside the agent's namespace (%q)", obj.Namespace)
			}
			checkRules(obj.Rules, false, func(f string, a ...any) { bad(o, f, a...) })
		}
	}
	if daemonsets != 1 {
		v = append(v, fmt.Sprintf("want exactly one DaemonSet, found %d", daemonsets))
	}
	return v
}

func checkRules(rules []rbacv1.PolicyRule, cluster bool, bad func(string, ...any)) {
	for _, r := range rules {
		// A rule with a write names exactly one allowed write's group and
		// resource, and only its verbs.
		var writes []string
		if len(r.APIGroups) == 1 && len(r.Resources) == 1 {
			writes = allowedWrites[r.APIGroups[0]+"/"+r.Resources[0]]
		}
		for _, verb := range r.Verbs {
			if !slices.Contains(readOnlyVerbs, verb) && !slices.Contains(writes, verb) {
				bad("verb %q: the agent only reads (get, list, watch), and writes only %v", verb, allowedWrites)
			}
		}
		for _, res := range r.Resources {
			if res == "*" || (strings.Contains(res, "/") && writes == nil) {
				bad("resource %q: no wildcards or subresources", res)
			}
			if cluster && res == "secrets" {
				bad("secrets cluster-wide: remote secrets are read through a Role in the agent's namespace")
			}
		}
		if slices.Contains(r.APIGroups, "*") || len(r.NonResourceURLs) > 0 {
			bad("wildcard API group or non-resource URL")
		}
	}
}

func checkDaemonSet(ds *appsv1.DaemonSet, bad func(string, ...any)) {
	u := ds.Spec.UpdateStrategy
	if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil {
		bad("updateStrategy must be RollingUpdate with maxSurge 1, maxUnavailable 0")
	} else {
		if s := u.RollingUpdate.MaxSurge; s == nil || s.String() != "1" {
			bad("rollingUpdate.maxSurge must be 1, is %v", s)
		}
		if m := u.RollingUpdate.MaxUnavailable; m == nil || m.String() != "0" {
			bad("rollingUpdate.maxUnavailable must be 0, is %v", m)
		}
	}
	p := ds.Spec.Template.Spec
	if !p.HostNetwork {
		bad("hostNetwork must be true (the agent captures the node's DNS)")
	}
	if p.HostPID || p.HostIPC {
		bad("hostPID/hostIPC must be off")
	}
	if p.DNSPolicy != corev1.DNSDefault {
		bad("dnsPolicy must be Default (upstreams are the node's nameservers, never the cluster DNS it answers), is %q", p.DNSPolicy)
	}
	if p.PriorityClassName != "system-node-critical" {
		bad("priorityClassName must be system-node-critical")
	}
	if !slices.ContainsFunc(p.Tolerations, func(t corev1.Toleration) bool {
		return t.Key == "" && t.Operator == corev1.TolerationOpExists && t.Effect == ""
	}) {
		bad("must tolerate every taint (operator: Exists)")
	}
	if sc := p.SecurityContext; sc != nil && sc.SeccompProfile != nil && sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		bad("pod seccompProfile %q: want RuntimeDefault", sc.SeccompProfile.Type)
	}
	checkPlacement(p, bad)
	for _, vol := range p.Volumes {
		if hp := vol.HostPath; hp != nil && !slices.Contains(allowedHostPaths, hp.Path) {
			bad("volume %q mounts host path %s: allowed are %v", vol.Name, hp.Path, allowedHostPaths)
		}
	}
	if g := p.TerminationGracePeriodSeconds; g == nil || *g < minGrace {
		bad("terminationGracePeriodSeconds must be at least %d (a handover in progress, then the drain)", minGrace)
	}
	if len(p.InitContainers) > 0 || len(p.EphemeralContainers) > 0 {
		bad("no init or ephemeral containers")
	}
	for _, c := range p.Containers {
		cbad := func(f string, a ...any) { bad("container "+c.Name+": "+f, a...) }
		checkContainer(c, p.SecurityContext, cbad)
		checkLSM(c, ds.Spec.Template.Annotations, cbad)
		checkMemoryLimitEnv(c, cbad)
	}
}

// checkPlacement: Linux nodes only, of the architectures the image is built
// for (imageArches), through a required node affinity on kubernetes.io/arch.
func checkPlacement(p corev1.PodSpec, bad func(string, ...any)) {
	if p.NodeSelector["kubernetes.io/os"] != "linux" {
		bad("nodeSelector must hold kubernetes.io/os: linux, has %v", p.NodeSelector)
	}
	var arches []string
	if a := p.Affinity; a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
		for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
			for _, e := range term.MatchExpressions {
				if e.Key == "kubernetes.io/arch" && e.Operator == corev1.NodeSelectorOpIn {
					arches = append(arches, e.Values...)
				}
			}
		}
	}
	if v, ok := p.NodeSelector["kubernetes.io/arch"]; ok {
		arches = append(arches, v)
	}
	slices.Sort(arches)
	if want := imageArches(); !slices.Equal(arches, want) {
		bad("nodes of architectures %v are selected (kubernetes.io/arch node affinity), the image is built for %v", arches, want)
	}
}

// checkLSM: AppArmor unconfined (the field, and the annotation that API
// servers before 1.30 read, agreeing) and SELinux type spc_t: the runtime's
// default profiles deny the agent's bpffs writes (docs/kubernetes.md).
func checkLSM(c corev1.Container, annotations map[string]string, bad func(string, ...any)) {
	sc := c.SecurityContext
	if sc == nil || sc.AppArmorProfile == nil || sc.AppArmorProfile.Type != corev1.AppArmorProfileTypeUnconfined {
		bad("appArmorProfile must be Unconfined (the runtime default denies writes under /sys/fs/bpf)")
	}
	if a := annotations[apparmorAnnotation+c.Name]; a != "unconfined" {
		bad("annotation %s%s is %q: API servers before 1.30 need it, unconfined, as the field", apparmorAnnotation, c.Name, a)
	}
	if sc == nil || sc.SELinuxOptions == nil || sc.SELinuxOptions.Type != "spc_t" {
		bad("seLinuxOptions.type must be spc_t")
	}
}

// checkMemoryLimitEnv: the Go memory limit follows the container's memory
// limit (resourceFieldRef), never a number written beside it.
func checkMemoryLimitEnv(c corev1.Container, bad func(string, ...any)) {
	var ref *corev1.ResourceFieldSelector
	for _, e := range c.Env {
		switch e.Name {
		case "GOMEMLIMIT":
			bad("GOMEMLIMIT is set (%q): it would not follow the memory limit; the agent derives it from MESHDNS_MEMORY_LIMIT", e.Value)
		case "MESHDNS_MEMORY_LIMIT":
			if e.ValueFrom != nil {
				ref = e.ValueFrom.ResourceFieldRef
			}
		}
	}
	if ref == nil || ref.Resource != "limits.memory" || (ref.ContainerName != "" && ref.ContainerName != c.Name) ||
		(!ref.Divisor.IsZero() && ref.Divisor.Cmp(resource.MustParse("1")) != 0) {
		bad("MESHDNS_MEMORY_LIMIT must be the container's limits.memory in bytes (resourceFieldRef), is %+v", ref)
	}
}

// Probes and the grace period (docs/kubernetes.md, "Upgrade"): every probe is
// the agent's own exec probe, which asks this pod's agent. An HTTP probe of the
// node IP is answered by the old pod's agent during a surge rollout, which
// makes the new pod Ready (and the old one deleted) before its agent took over.
const (
	// minProbeTimeout: `meshdns-ebpf probe` gives the agent 3 s.
	minProbeTimeout = 3
	// minGrace: a stopping agent first waits for a handover in progress (30 s),
	// then drains (up to 5 s).
	minGrace = 36
)

func checkProbes(c corev1.Container, bad func(string, ...any)) {
	for _, probe := range []struct {
		name, check string
		p           *corev1.Probe
	}{{"startupProbe", "live", c.StartupProbe}, {"livenessProbe", "live", c.LivenessProbe}, {"readinessProbe", "ready", c.ReadinessProbe}} {
		want := []string{"/usr/local/bin/meshdns-ebpf", "probe", probe.check}
		switch {
		case probe.p == nil:
			bad("no %s", probe.name)
		case probe.p.Exec == nil:
			bad("%s must be an exec probe running %v (an HTTP probe of the node IP is answered by the old pod during a rollout)", probe.name, want)
		case !slices.Equal(probe.p.Exec.Command, want):
			bad("%s runs %v, want %v", probe.name, probe.p.Exec.Command, want)
		case probe.p.TimeoutSeconds < minProbeTimeout:
			bad("%s timeoutSeconds %d: the probe takes up to %d s", probe.name, probe.p.TimeoutSeconds, minProbeTimeout)
		}
	}
}

func checkContainer(c corev1.Container, pod *corev1.PodSecurityContext, bad func(string, ...any)) {
	if len(c.Ports) > 0 {
		bad("declares ports %v: with hostNetwork they are host ports and block the surge pod", c.Ports)
	}
	sc := c.SecurityContext
	if sc == nil {
		bad("no securityContext")
		return
	}
	if sc.Privileged != nil && *sc.Privileged {
		bad("privileged")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		bad("allowPrivilegeEscalation must be false")
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		bad("readOnlyRootFilesystem must be true")
	}
	seccomp := sc.SeccompProfile
	if seccomp == nil && pod != nil {
		seccomp = pod.SeccompProfile
	}
	if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		bad("seccompProfile must be RuntimeDefault")
	}
	if sc.ProcMount != nil && *sc.ProcMount != corev1.DefaultProcMount {
		bad("procMount must be Default")
	}
	if caps := sc.Capabilities; caps == nil || !slices.Contains(caps.Drop, "ALL") {
		bad("capabilities must drop ALL")
	} else {
		for _, a := range caps.Add {
			if a == "SYS_ADMIN" || a == "CAP_SYS_ADMIN" {
				bad("asks for SYS_ADMIN")
			} else if !slices.Contains(allowedCaps, a) {
				bad("asks for capability %s: allowed are %v", a, allowedCaps)
			}
		}
	}
	checkProbes(c, bad)
	if lim, ok := c.Resources.Limits[corev1.ResourceMemory]; !ok || lim.Cmp(minMemoryLimit) < 0 {
		bad("memory limit must be at least %s", minMemoryLimit.String())
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	if e, ok := env["NODE_NAME"]; !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		bad("NODE_NAME must come from the downward API (spec.nodeName)")
	}
	if !slices.Contains(c.Args, "--kubernetes") {
		bad("args must include --kubernetes")
	}
	for _, a := range c.Args {
		if strings.HasPrefix(a, "--admin=") && strings.HasPrefix(strings.TrimPrefix(a, "--admin="), "127.") {
			bad("%s: a loopback admin address is unreachable for Prometheus", a)
		}
	}
}
