// Package meshdata generates the benchmark's data set: one mesh name table
// (svc-N.ns-M.svc.cluster.local -> a fake, non-routable IPv4 address), rendered
// for every server under test (CoreDNS Corefiles, unbound local-data, dnsmasq
// addn-hosts, the floor's hosts file, meshdns's JSON name table), and the dnsperf
// query files of the scenarios. Everything is deterministic for a given size and
// seed, so every peer serves exactly the same data.
package meshdata

import (
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"net/netip"
	"strings"
)

const (
	// Zone is the mesh zone every peer is authoritative for.
	Zone = "cluster.local."
	// MeshTTL is the TTL of table answers, the same for every peer.
	MeshTTL = 30
	// ServicesPerNamespace fixes the table shape: N services = N/100 namespaces.
	ServicesPerNamespace = 100
	// ExternalSuffix is where forwarded (non-mesh) names live; the fake upstream
	// answers them with an A record.
	ExternalSuffix = "example.com."
	// NXSuffix is the suffix the fake upstream answers with NXDOMAIN (plus SOA).
	NXSuffix = "nx.example.net."
)

// Service is one row of the mesh table.
type Service struct {
	Name      string // short name, e.g. "svc-7"
	Namespace string // e.g. "ns-3"
	IP        netip.Addr
}

// FQDN is the service's fully qualified name with the trailing dot.
func (s Service) FQDN() string {
	return s.Name + "." + s.Namespace + ".svc." + Zone
}

// Table is the mesh table.
type Table struct {
	Services []Service
	// Generation is mixed into the addresses so that a rewritten table (live
	// reload) changes every answer while keeping the names.
	Generation int
}

// NewTable returns n services in ceil(n/100) namespaces with addresses in
// 240.0.0.0/4 (reserved, never routed; they are only answers).
func NewTable(n, generation int) Table {
	t := Table{Services: make([]Service, n), Generation: generation}
	for i := range n {
		t.Services[i] = Service{
			Name:      fmt.Sprintf("svc-%d", i%ServicesPerNamespace),
			Namespace: fmt.Sprintf("ns-%d", i/ServicesPerNamespace),
			IP:        ServiceIP(i, generation),
		}
	}
	return t
}

// PartialTable is generation base's table with one service in every
// `every`, and the last one, at generation gen: a rewrite that changes
// about 1/every of the names (the last one can be probed for the change).
func PartialTable(n, base, gen, every int) Table {
	t := NewTable(n, base)
	for i := range t.Services {
		if i%every == 0 || i == n-1 {
			t.Services[i].IP = ServiceIP(i, gen)
		}
	}
	return t
}

// ServiceIP is the address of service i (< 2^24-1) in a table generation:
// (240 + generation%16).0.0.0 + i + 1, so generations differ in the first octet.
func ServiceIP(i, generation int) netip.Addr {
	v := uint32(i + 1)
	return netip.AddrFrom4([4]byte{byte(240 + generation%16), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Namespaces lists the table's namespaces in order.
func (t Table) Namespaces() []string {
	var out []string
	seen := map[string]bool{}
	for _, s := range t.Services {
		if !seen[s.Namespace] {
			seen[s.Namespace] = true
			out = append(out, s.Namespace)
		}
	}
	return out
}

// ExternalName is the i-th forwarded name.
func ExternalName(i int) string { return fmt.Sprintf("e-%d.%s", i, ExternalSuffix) }

// SOA is the synthesized SOA of the mesh zone, the same for all peers (zone file
// syntax, MeshTTL as minimum so negative answers are cached for MeshTTL).
func SOA() string {
	return fmt.Sprintf("%s %d IN SOA ns.dns.%s hostmaster.%s 1 7200 1800 86400 %d", Zone, MeshTTL, Zone, Zone, MeshTTL)
}

// Hosts renders "IP FQDN" lines (no trailing dot), the /etc/hosts format read by
// CoreDNS hosts, dnsmasq --addn-hosts and the floor server.
func (t Table) Hosts() string {
	var b strings.Builder
	b.Grow(len(t.Services) * 48)
	for _, s := range t.Services {
		b.WriteString(s.IP.String())
		b.WriteByte(' ')
		b.WriteString(strings.TrimSuffix(s.FQDN(), "."))
		b.WriteByte('\n')
	}
	return b.String()
}

// Query is one dnsperf query line.
type Query struct {
	Name string // FQDN, trailing dot
	Type string // "A", "AAAA"
}

// Line is the dnsperf data-file form ("name type").
func (q Query) Line() string { return strings.TrimSuffix(q.Name, ".") + " " + q.Type }

// QueryFile renders queries as a dnsperf data file.
func QueryFile(qs []Query) string {
	var b strings.Builder
	for _, q := range qs {
		b.WriteString(q.Line())
		b.WriteByte('\n')
	}
	return b.String()
}

// InTableQueries is scenario (a): one A query per table name, shuffled.
func (t Table) InTableQueries(seed uint64) []Query {
	qs := make([]Query, len(t.Services))
	for i, s := range t.Services {
		qs[i] = Query{Name: s.FQDN(), Type: "A"}
	}
	shuffle(qs, seed)
	return qs
}

// ForwardQueries is scenario (b): n forwarded names (A), shuffled; after warm-up
// every peer serves them from its cache.
func ForwardQueries(n int, seed uint64) []Query {
	qs := make([]Query, n)
	for i := range n {
		qs[i] = Query{Name: ExternalName(i), Type: "A"}
	}
	shuffle(qs, seed)
	return qs
}

// SearchList is the resolv.conf search list of a pod in namespace ns.
func SearchList(ns string) []string {
	return []string{ns + ".svc." + Zone, "svc." + Zone, Zone}
}

// NdotsLookup expands one application lookup of name (written without the
// trailing dot, fewer than 5 dots) the way glibc does with ndots:5: every search
// suffix first (each must be NXDOMAIN, or answered by an autopath-style
// shortcut), then the name itself; A and AAAA for each candidate.
func NdotsLookup(name, clientNS string) []Query {
	name = strings.TrimSuffix(name, ".")
	var qs []Query
	for _, suffix := range SearchList(clientNS) {
		cand := name + "." + suffix
		qs = append(qs, Query{Name: cand, Type: "A"}, Query{Name: cand, Type: "AAAA"})
	}
	return append(qs, Query{Name: name + ".", Type: "A"}, Query{Name: name + ".", Type: "AAAA"})
}

// NdotsQueries is scenario (c): lookups lookups, alternating between a mesh
// service name written as "svc-N.ns-M.svc.cluster.local" (4 dots) and an
// external name, each from a pod in a random namespace, expanded by NdotsLookup
// (8 queries per lookup: 6 search-suffixed, 2 for the real name). The order of
// queries within one lookup is kept; lookups are in random order.
func (t Table) NdotsQueries(lookups int, seed uint64) []Query {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	nss := t.Namespaces()
	qs := make([]Query, 0, lookups*8)
	for i := range lookups {
		clientNS := nss[r.IntN(len(nss))]
		var name string
		if i%2 == 0 {
			name = t.Services[r.IntN(len(t.Services))].FQDN()
		} else {
			name = ExternalName(r.IntN(1000))
		}
		qs = append(qs, NdotsLookup(name, clientNS)...)
	}
	return qs
}

func shuffle(qs []Query, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	r.Shuffle(len(qs), func(i, j int) { qs[i], qs[j] = qs[j], qs[i] })
}

// ExternalIP is the fake upstream's deterministic A answer for name: an address
// in 198.18.0.0/15 derived from the FNV-1a hash of the lower-case FQDN.
func ExternalIP(name string) netip.Addr {
	h := fnv.New32a()
	h.Write([]byte(strings.ToLower(name)))
	if !strings.HasSuffix(name, ".") {
		h.Write([]byte("."))
	}
	v := h.Sum32() & 0x1ffff
	return netip.AddrFrom4([4]byte{198, 18 + byte(v>>16), byte(v >> 8), byte(v)})
}
