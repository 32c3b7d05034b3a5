// Package nameview lists a published name table for people and tools: the
// rows of `meshdns-ebpf table` (which the agent serves at /debug/table),
// with filters by name, namespace, source and client namespace, and the
// same data in Istio's NameTable JSON, as istiod's /debug/ndsz shows it.
// It reads nametable.Table only; the query path never uses it.
package nameview

import (
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// Entry is one name of the table as one set of clients sees it. A name
// visible to some namespaces only (a ServiceEntry's exportTo) has one
// entry per variant, in the order clients try them.
type Entry struct {
	// Name is the queried name, without the trailing dot.
	Name string `json:"name"`
	// Type is what answers it: service (a ClusterIP Service), headless,
	// endpoint (a headless Service's endpoint), cname (an ExternalName
	// Service), vip (a host with a VIP the table allocated), host (any
	// other host with its own addresses).
	Type      string   `json:"type"`
	Addresses []string `json:"addresses,omitempty"`
	CNAME     string   `json:"cname,omitempty"`
	// Source is the name source whose host wins the name; Object the
	// source's object (a Service's or ServiceEntry's namespace/name).
	Source string `json:"source"`
	Object string `json:"object,omitempty"`
	// Namespace is the object's namespace, if it has one.
	Namespace string `json:"namespace,omitempty"`
	// VisibleTo is the client namespaces that get this entry; ["*"] is
	// every client.
	VisibleTo []string `json:"visibleTo"`
	// AliasOf is the host whose alternative name this is.
	AliasOf string `json:"aliasOf,omitempty"`
	// Ports are the SRV records: name/protocol/port, and the target when
	// it is not the host itself.
	Ports []string `json:"ports,omitempty"`
}

// Filter selects entries. Empty fields select everything.
type Filter struct {
	// Name matches names containing it, or, with a '*' or '?', names
	// matching it as a glob (path.Match); case-insensitive, trailing dot
	// optional.
	Name string
	// Namespace is the object's namespace.
	Namespace string
	// Source is a source name or glob ("cluster/*").
	Source string
	// Client, when set, lists what a client of that namespace gets: per
	// name only the first entry it sees.
	Client string
}

// List returns the entries of t that f selects, sorted by name.
func List(t *nametable.Table, f Filter) []Entry {
	if t == nil {
		return nil
	}
	name := strings.TrimSuffix(strings.ToLower(f.Name), ".")
	glob := strings.ContainsAny(name, "*?[")
	var out []Entry
	taken := "" // the name whose client view is already listed
	t.Each(func(full string, n *nametable.Name) bool {
		h := n.Host
		if f.Client != "" {
			// The client gets the first entry it sees, whatever the
			// other filters say of it.
			if full == taken || !h.VisibleTo(f.Client, true) {
				return true
			}
			taken = full
		}
		owner := strings.TrimSuffix(full, ".")
		switch {
		case name == "":
		case glob:
			if ok, _ := path.Match(name, owner); !ok {
				return true
			}
		case !strings.Contains(owner, name):
			return true
		}
		if f.Source != "" {
			if ok, _ := path.Match(f.Source, h.Source()); !ok {
				return true
			}
		}
		ns := namespaceOf(h)
		if f.Namespace != "" && ns != f.Namespace {
			return true
		}
		out = append(out, entryOf(owner, h, ns))
		return true
	})
	slices.SortStableFunc(out, func(a, b Entry) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func entryOf(owner string, h *nametable.Host, ns string) Entry {
	e := Entry{Name: owner, Type: kind(h), Source: h.Source(), Object: h.Key(), Namespace: ns, Addresses: addrs(h)}
	if h.CNAME() != "" {
		e.CNAME = strings.TrimSuffix(h.CNAME(), ".")
	}
	if h.Visible() == nil {
		e.VisibleTo = []string{"*"}
	} else {
		e.VisibleTo = slices.Clone(h.Visible())
	}
	if hn := strings.TrimSuffix(h.Name, "."); hn != owner {
		e.AliasOf = hn
	}
	for _, p := range h.Ports {
		s := fmt.Sprintf("%s/%s/%d", p.Name, p.Protocol, p.Port)
		if p.Target != "" && p.Target != h.Name {
			s += " " + strings.TrimSuffix(p.Target, ".")
		}
		e.Ports = append(e.Ports, s)
	}
	return e
}

func kind(h *nametable.Host) string {
	switch {
	case h.CNAME() != "":
		return "cname"
	case h.Kubernetes && h.Merge:
		return "headless"
	case h.Kubernetes:
		return "service"
	case h.Merge:
		return "endpoint"
	case h.AutoVIP:
		return "vip"
	}
	return "host"
}

func addrs(h *nametable.Host) []string {
	var out []string
	for _, a := range h.V4 {
		out = append(out, a.String())
	}
	for _, a := range h.V6 {
		out = append(out, a.String())
	}
	return out
}

// namespaceOf is a Kubernetes host's namespace, or the namespace of the
// object ("namespace/name") that contributed it.
func namespaceOf(h *nametable.Host) string {
	if h.Namespace() != "" {
		return h.Namespace()
	}
	if ns, _, ok := strings.Cut(h.Key(), "/"); ok {
		return ns
	}
	return ""
}

// maxAddrs is how many addresses a table row shows (all are in JSON).
const maxAddrs = 4

// WriteTable prints entries as an aligned table.
func WriteTable(w io.Writer, entries []Entry) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tTYPE\tADDRESSES\tSOURCE\tVISIBLE-TO")
	for _, e := range entries {
		a := e.Addresses
		more := ""
		if len(a) > maxAddrs {
			a, more = a[:maxAddrs], fmt.Sprintf(" (+%d)", len(e.Addresses)-maxAddrs)
		}
		addr := strings.Join(a, ",") + more
		if e.CNAME != "" {
			addr = "CNAME " + e.CNAME
		}
		typ := e.Type
		if e.AliasOf != "" {
			typ += " (alias of " + e.AliasOf + ")"
		}
		src := e.Source
		if strings.Contains(e.Object, "/") {
			src += " " + e.Object // a namespaced object
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", e.Name, typ, addr, src, strings.Join(e.VisibleTo, ","))
	}
	return tw.Flush()
}

// NameTable is Istio's NameTable (istio.io/istio pkg/dns/proto, the
// table istiod sends its DNS proxies) in its JSON form. Its entries are the
// names file's (nametable.HostInfo: Istio's NameInfo, whose ports NDS never
// sets).
type NameTable struct {
	Table map[string]nametable.HostInfo `json:"table"`
}

// NDS returns the table as a client of namespace ns sees it (ns "": a
// client whose namespace is unknown), in Istio's format: hosts with
// addresses, keyed by name without the trailing dot, Registry
// "Kubernetes" for Services (local or remote) and their endpoints, else
// "External"; short name and namespace for Services, as Istio gives them.
func NDS(t *nametable.Table, ns string) NameTable {
	out := NameTable{Table: map[string]nametable.HostInfo{}}
	if t == nil {
		return out
	}
	taken := ""
	t.Each(func(owner string, n *nametable.Name) bool {
		h := n.Host
		if owner != h.Name || owner == taken || !h.VisibleTo(ns, ns != "") {
			return true
		}
		taken = owner
		if !h.HasData() || h.CNAME() != "" {
			return true // Istio's table has addresses only
		}
		info := nametable.HostInfo{IPs: addrs(h), Registry: "External"}
		if src := h.Source(); h.Kubernetes || src == "kubernetes" || strings.HasPrefix(src, "cluster/") {
			info.Registry = nametable.RegistryKubernetes
		}
		if h.Kubernetes {
			info.Shortname, info.Namespace = h.Shortname(), h.Namespace()
		}
		for _, a := range h.AltNames() {
			info.AltHosts = append(info.AltHosts, strings.TrimSuffix(a, "."))
		}
		out.Table[strings.TrimSuffix(owner, ".")] = info
		return true
	})
	return out
}
