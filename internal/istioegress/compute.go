// Package istioegress turns Istio's REGISTRY_ONLY outbound traffic policy
// into egress policies, as a sidecar would enforce it: a namespace under
// REGISTRY_ONLY may use the ServiceEntry hosts exported to it and the
// cluster's Services, and nothing else.
//
// Where the mode comes from, as Istio resolves it for a workload without a
// Sidecar of its own: the namespace's Sidecar without workloadSelector
// (the oldest, when there are several), else the root namespace's Sidecar
// without workloadSelector, else the mesh config (the "mesh" key of the
// "istio" ConfigMap in the root namespace), else ALLOW_ANY. A Sidecar that
// sets no outboundTrafficPolicy inherits. Sidecars with a workloadSelector
// are not read: their pods get the namespace's mode.
//
// What is allowed: every ServiceEntry host visible to the namespace
// (exportTo empty or "*": every namespace; ".": its own; "~": none; names:
// those namespaces), wildcards included ("*.example.com" matches every
// depth, as Istio's), and "*.svc.<cluster domain>", every Service name of
// the cluster, ExternalName Services included (the resolver grants a CNAME
// chain's final addresses, as Istio's registry holds ExternalName
// Services). Ports are not narrowed (a sidecar also matches the
// ServiceEntry's ports), a Service's networking.istio.io/exportTo
// annotation and a Sidecar's egress hosts are not applied, and hosts that
// are not DNS names (short names, "*") are left out. The ServiceEntries are
// those the ServiceEntry name source (internal/meshsource) watches: one
// watch serves both.
//
// The policies are enforce, fail-open unless the source is configured
// fail-closed (a sidecar-less workload with no agent behaves as without
// Istio), with cluster-internal destinations out of scope. A mesh-wide
// REGISTRY_ONLY is one policy of every namespace, except those whose own
// Sidecar says ALLOW_ANY, plus a policy per namespace that sees hosts the
// others do not; the policies of one workload combine (their names add up).
package istioegress

import (
	"cmp"
	"maps"
	"slices"
	"strings"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
)

// SourceName is the Source of the policies.
const SourceName = "istio-registry-only"

// Outbound traffic policy modes.
const (
	RegistryOnly = "REGISTRY_ONLY"
	AllowAny     = "ALLOW_ANY"
)

// Sidecar is what the computation reads of a Sidecar.
type Sidecar struct {
	Namespace, Name string
	// Created orders Sidecars of one namespace (RFC 3339, UTC).
	Created string
	// Selector: the Sidecar has a workloadSelector (it is not read).
	Selector bool
	// Mode is its outboundTrafficPolicy.mode ("" when unset).
	Mode string
}

// ServiceEntry is what the computation reads of a ServiceEntry.
type ServiceEntry struct {
	Namespace, Name string
	Hosts           []string
	ExportTo        []string
}

// Inputs are the Istio objects of the cluster.
type Inputs struct {
	RootNamespace  string // default istio-system
	MeshMode       string // the mesh config's outboundTrafficPolicy.mode ("" when unset)
	Sidecars       []Sidecar
	ServiceEntries []ServiceEntry
	Domain         string // cluster domain, default cluster.local
	FailMode       egresspolicy.FailMode
}

// Compute returns the REGISTRY_ONLY policies of in, in a stable order.
func Compute(in Inputs) []egresspolicy.Policy {
	if in.RootNamespace == "" {
		in.RootNamespace = "istio-system"
	}
	if in.Domain == "" {
		in.Domain = "cluster.local"
	}
	if in.FailMode == "" {
		in.FailMode = egresspolicy.FailOpen
	}
	// The namespace-wide Sidecar of each namespace: the oldest.
	own := map[string]Sidecar{}
	for _, sc := range in.Sidecars {
		if sc.Selector {
			continue
		}
		if cur, ok := own[sc.Namespace]; !ok || cmp.Or(cmp.Compare(sc.Created, cur.Created), cmp.Compare(sc.Name, cur.Name)) < 0 {
			own[sc.Namespace] = sc
		}
	}
	meshMode := cmp.Or(in.MeshMode, AllowAny)
	if root, ok := own[in.RootNamespace]; ok && root.Mode != "" {
		meshMode = root.Mode
	}
	// modeOf is the mode of a namespace.
	modeOf := func(ns string) string {
		if sc, ok := own[ns]; ok && sc.Mode != "" && ns != in.RootNamespace {
			return sc.Mode
		}
		return meshMode
	}

	services := "*." + "svc." + strings.TrimSuffix(in.Domain, ".")
	everywhere := map[string]bool{}
	only := map[string]map[string]bool{} // namespace -> hosts only it sees
	for _, se := range in.ServiceEntries {
		hosts := usable(se.Hosts)
		if len(hosts) == 0 {
			continue
		}
		exports := se.ExportTo
		if len(exports) == 0 {
			exports = []string{"*"}
		}
		for _, e := range exports {
			var to string
			switch e {
			case "*":
				for _, h := range hosts {
					everywhere[h] = true
				}
				continue
			case "~":
				continue
			case ".":
				to = se.Namespace
			default:
				to = e
			}
			if only[to] == nil {
				only[to] = map[string]bool{}
			}
			for _, h := range hosts {
				only[to][h] = true
			}
		}
	}

	policy := func(name, ns string, hosts ...map[string]bool) egresspolicy.Policy {
		set := map[string]bool{}
		for _, h := range hosts {
			for k := range h {
				set[k] = true
			}
		}
		names := slices.Sorted(maps.Keys(set))
		return egresspolicy.Policy{Source: SourceName, Name: name, Namespace: ns,
			Egress: []egresspolicy.Rule{{Names: names}}, Mode: egresspolicy.Enforce, FailMode: in.FailMode}
	}
	var out []egresspolicy.Policy
	if meshMode == RegistryOnly {
		// One policy of every namespace but those that opted out.
		var open []string
		for ns := range own {
			if modeOf(ns) != RegistryOnly {
				open = append(open, ns)
			}
		}
		slices.Sort(open)
		p := policy("mesh", "", everywhere, map[string]bool{services: true})
		p.ExcludeNamespaces = open
		out = append(out, p)
		for _, ns := range slices.Sorted(maps.Keys(only)) {
			if modeOf(ns) == RegistryOnly {
				out = append(out, policy(ns, ns, only[ns]))
			}
		}
		return out
	}
	for _, ns := range slices.Sorted(maps.Keys(own)) {
		if modeOf(ns) == RegistryOnly {
			out = append(out, policy(ns, ns, everywhere, only[ns], map[string]bool{services: true}))
		}
	}
	return out
}

// usable keeps the hosts an egress policy can name (lowercased).
func usable(hosts []string) []string {
	var out []string
	for _, h := range hosts {
		h = strings.ToLower(strings.TrimSuffix(h, "."))
		if !strings.Contains(h, ".") {
			continue // a short name or "*"
		}
		p := egresspolicy.Policy{Namespace: "x", Mode: egresspolicy.Enforce, FailMode: egresspolicy.FailOpen,
			Egress: []egresspolicy.Rule{{Names: []string{h}}}}
		if p.Validate() == nil {
			out = append(out, h)
		}
	}
	return out
}
