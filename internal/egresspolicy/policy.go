// Package egresspolicy is the policy half of DNS-gated egress: the Policy a
// source (the DNSEgressPolicy CRD, Istio's REGISTRY_ONLY, the VM policy
// file) produces, its validation, name matching, and the immutable Set the
// agent asks which policy governs a workload (Select) and the resolver asks
// which ports a name opens (Policy.Allows). It has no Kubernetes and no BPF
// code: sources convert into it, the datapath (internal/egress) converts
// out of it.
//
// Names. A name is exact ("api.example.com") or a wildcard "*.example.com".
// Matching is case-insensitive and a trailing dot is optional on both
// sides. "*.example.com" matches every name below example.com, at any depth
// (a.example.com, a.b.example.com), and not example.com itself: list the
// apex as a name of its own. This is Envoy's and Istio's reading of a
// leading wildcard (a ServiceEntry host "*.example.com" covers every
// depth), so Istio's REGISTRY_ONLY hosts carry over unchanged; it equals
// Cilium's "**.example.com", while Cilium's "*.example.com" covers one
// label only. "*" alone, a "*" anywhere but a whole leftmost label
// ("a.*.b", "*a.b", "**.b") are invalid.
//
// Combination. Several policies selecting one workload act as one policy:
// the allowed names are the union (each name keeps its own ports, and a
// name matched by several entries gets the union of their ports, "any
// port" absorbing the rest); enforce wins over audit; fail-closed wins over
// fail-open; cluster-internal destinations are in scope when any policy
// puts them in scope. The stricter mode always wins, the allowlist grows.
package egresspolicy

import (
	"slices"
	"strings"
)

// Mode is what a policy does to a connect to an address no allowed name
// resolved to.
type Mode string

const (
	// Enforce denies it (EPERM).
	Enforce Mode = "enforce"
	// Audit allows and records it.
	Audit Mode = "audit"
)

// FailMode is what a policy's workloads get while no agent runs (the
// pinned datapath keeps the last rules).
type FailMode string

const (
	// FailOpen allows every connect while no agent grants.
	FailOpen FailMode = "fail-open"
	// FailClosed keeps enforcing: only grants still live are allowed.
	FailClosed FailMode = "fail-closed"
)

// Protocol is a transport protocol of a Port.
type Protocol string

const (
	TCP Protocol = "TCP"
	UDP Protocol = "UDP"
)

// Port is a destination port and protocol. Port is an int32, as in
// Kubernetes, so that validation can name an out-of-range value.
type Port struct {
	Port     int32    `json:"port"`
	Protocol Protocol `json:"protocol,omitempty"`
}

// Rule allows names on ports. No ports: any port, any protocol.
type Rule struct {
	Names []string `json:"names"`
	Ports []Port   `json:"ports,omitempty"`
}

// Policy is one source object: which workloads it selects and what they
// may resolve and then connect to.
type Policy struct {
	// Source names where the policy comes from ("DNSEgressPolicy",
	// "istio-registry-only", "file") and Name the object within it
	// ("namespace/name", a file's policy name). Both only identify.
	Source string
	Name   string

	// Kubernetes: the policy's namespace and the pods of it its
	// selector selects (an empty selector selects every pod). No
	// namespace (and no Unit): the pods of every namespace but
	// ExcludeNamespaces (a mesh-wide policy, such as Istio's
	// REGISTRY_ONLY in the mesh config).
	Namespace         string
	ExcludeNamespaces []string
	PodSelector       Selector
	// VM: a systemd unit ("app.service") or a cgroup path (starting
	// with "/"). A policy with Unit selects only that workload and
	// never a pod.
	Unit string

	Egress          []Rule
	Mode            Mode
	FailMode        FailMode
	ClusterInternal bool // cluster-internal destinations are in scope

	ix index // compiled by NewSet
}

// Default fills what a source may leave out: mode enforce, fail mode
// fail-open (a policy must say fail-closed to keep a workload closed while
// no agent runs), protocol TCP (as Kubernetes' ports). Validate accepts
// only what Default produces or a valid explicit value.
func (p *Policy) Default() {
	if p.Mode == "" {
		p.Mode = Enforce
	}
	if p.FailMode == "" {
		p.FailMode = FailOpen
	}
	for i := range p.Egress {
		for j := range p.Egress[i].Ports {
			if p.Egress[i].Ports[j].Protocol == "" {
				p.Egress[i].Ports[j].Protocol = TCP
			}
		}
	}
}

// ID is the policy's identity within its set: "source name".
func (p *Policy) ID() string { return p.Source + " " + p.Name }

// clone copies what a Set must own.
func (p *Policy) clone() *Policy {
	c := *p
	c.ix = index{}
	c.PodSelector = p.PodSelector.clone()
	c.ExcludeNamespaces = slices.Clone(p.ExcludeNamespaces)
	c.Egress = make([]Rule, len(p.Egress))
	for i, r := range p.Egress {
		c.Egress[i] = Rule{Names: slices.Clone(r.Names), Ports: slices.Clone(r.Ports)}
	}
	return &c
}

// Workload is what Select matches: a pod (Namespace, Labels) or a VM's
// systemd unit or cgroup path (Unit).
type Workload struct {
	Namespace string
	Labels    map[string]string
	Unit      string
}

// selects reports whether p selects w.
func (p *Policy) selects(w Workload) bool {
	if p.Unit != "" || w.Unit != "" {
		return p.Unit == w.Unit
	}
	if p.Namespace == "" {
		return !slices.Contains(p.ExcludeNamespaces, w.Namespace) && p.PodSelector.Matches(w.Labels)
	}
	return p.Namespace == w.Namespace && p.PodSelector.Matches(w.Labels)
}

// normalize lowercases a name and drops one trailing dot; it allocates
// only when the name has an upper-case letter.
func normalize(name string) string {
	name = strings.TrimSuffix(name, ".")
	for i := 0; i < len(name); i++ {
		if c := name[i]; 'A' <= c && c <= 'Z' {
			return strings.ToLower(name)
		}
	}
	return name
}
