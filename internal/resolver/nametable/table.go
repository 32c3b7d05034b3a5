package nametable

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/miekg/dns"
)

// DefaultTTL is the TTL of table answers when Options.TTL is zero.
const DefaultTTL = 30 * time.Second

// DefaultClusterDomain is used when Options.ClusterDomain is empty.
const DefaultClusterDomain = "cluster.local"

// Options control how a File becomes a Table.
type Options struct {
	// ClusterDomain is the Kubernetes cluster domain (default cluster.local).
	// Kubernetes hosts under <ns>.svc.<ClusterDomain> get alt names.
	ClusterDomain string
	// TTL of every precomputed record and of the negative-answer SOA
	// (default 30s).
	TTL time.Duration
	// Serial is put in the synthesized SOA records (default 1). The Watcher
	// sets it to the number of successful loads.
	Serial uint32
}

func (o Options) withDefaults() Options {
	if o.ClusterDomain == "" {
		o.ClusterDomain = DefaultClusterDomain
	}
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.Serial == 0 {
		o.Serial = 1
	}
	return o
}

// Host is one table host with its precomputed answers. Immutable once built.
type Host struct {
	// Name is the canonical lower-case FQDN with trailing dot
	// ("*.example.com." for a wildcard host).
	Name       string
	Namespace  string
	Shortname  string
	Kubernetes bool
	Wildcard   bool
	// AutoVIP is true when V4/V6 were allocated by the table (external
	// host without addresses).
	AutoVIP bool
	V4, V6  []netip.Addr
	// A and AAAA are owned by Name.
	A, AAAA []dns.RR
	// Ports with their SRV records (owner _name._proto.Name).
	Ports []HostPort
	// SRV holds one record per port, owned by Name.
	SRV []dns.RR
	// SOA is the record to put in the authority section of a negative
	// answer (NODATA) for this host.
	SOA *dns.SOA
}

// HostPort is a port with its precomputed SRV answer.
type HostPort struct {
	Name     string // lower case
	Protocol string // "tcp", "udp" or "sctp"
	Port     uint16
	SRV      *dns.SRV // owned by _Name._Protocol.<host>
}

// Name is one queryable name (canonical or alternative) of a host.
type Name struct {
	// Owner is the lower-case name this entry is stored under.
	Owner string
	Host  *Host
	// A and AAAA are owned by Owner (for wildcard entries Owner starts with
	// "*." and callers must re-own the records to the queried name).
	A, AAAA []dns.RR
}

type nsKey struct{ label, ns string }

// Table is an immutable lookup snapshot. All methods are safe for concurrent
// use and take no locks.
type Table struct {
	names     map[string]*Name
	wildcards map[string]*Name // key: the parent of "*.", e.g. "example.com."
	ptr       map[string][]dns.RR
	bare      map[string]*Name // unambiguous bare names, key "reviews."
	byNS      map[nsKey]*Name  // bare name per namespace
	clients   map[netip.Addr]string
	ents      map[string]struct{}
	hosts     int
	skipped   []string
	domain    string // "cluster.local."
	ttl       uint32
	soa       *dns.SOA
}

// Len is the number of hosts in the table.
func (t *Table) Len() int { return t.hosts }

// Skipped lists hosts that were left out because they have no address
// (wildcard or Kubernetes hosts without IPs); their queries are forwarded.
func (t *Table) Skipped() []string { return t.skipped }

// Domain is the cluster domain, lower case with trailing dot.
func (t *Table) Domain() string { return t.domain }

// TTL is the TTL in seconds of the precomputed records.
func (t *Table) TTL() uint32 { return t.ttl }

// DomainSOA is the SOA of the cluster domain, used for NXDOMAIN answers.
func (t *Table) DomainSOA() *dns.SOA { return t.soa }

// Lookup returns the entry stored under the exact lower-case name.
func (t *Table) Lookup(name string) *Name { return t.names[name] }

// LookupPTR returns the PTR answers for a lower-case reverse name
// (x.x.x.x.in-addr.arpa. or nibbles.ip6.arpa.).
func (t *Table) LookupPTR(name string) []dns.RR { return t.ptr[name] }

// IsEmptyNonTerminal reports whether a lower-case name under the cluster
// domain exists only as the parent of table names (such as svc.<domain>.
// or <ns>.svc.<domain>.): NODATA, not NXDOMAIN.
func (t *Table) IsEmptyNonTerminal(name string) bool {
	_, ok := t.ents[name]
	return ok
}

// ClientNamespace returns the namespace of a client pod IP, if the table
// knows it.
func (t *Table) ClientNamespace(ip netip.Addr) (string, bool) {
	if len(t.clients) == 0 {
		return "", false
	}
	ns, ok := t.clients[ip.Unmap()]
	return ns, ok
}

// Find resolves a lower-case FQDN: an exact name, then, for a single label,
// the bare Kubernetes short name (the client's namespace when the client is
// known, else the only namespace that has it), then the closest enclosing
// wildcard. wildcard reports that the entry's records must be re-owned.
func (t *Table) Find(name string, client netip.Addr) (n *Name, wildcard bool) {
	if n := t.names[name]; n != nil {
		return n, false
	}
	if i := strings.IndexByte(name, '.'); i == len(name)-1 && i > 0 {
		if ns, ok := t.ClientNamespace(client); ok {
			return t.byNS[nsKey{name, ns}], false
		}
		return t.bare[name], false
	}
	if len(t.wildcards) == 0 {
		return nil, false
	}
	for i := 0; i < len(name)-1; i++ {
		if name[i] == '.' {
			if n := t.wildcards[name[i+1:]]; n != nil {
				return n, true
			}
		}
	}
	return nil, false
}

// Build validates a File and builds the lookup table. Errors name the host
// and field ("table[\"a.b\"].ips[1]: ...").
func Build(f *File, opts Options) (*Table, error) {
	opts = opts.withDefaults()
	domain := strings.ToLower(strings.Trim(opts.ClusterDomain, "."))
	if _, ok := dns.IsDomainName(domain); !ok || domain == "" {
		return nil, fmt.Errorf("cluster domain %q is not a domain name", opts.ClusterDomain)
	}
	domain += "."
	ttl := uint32(opts.TTL / time.Second)
	if ttl == 0 {
		ttl = 1
	}
	b := &builder{
		domain: domain,
		svc:    ".svc." + domain,
		ttl:    ttl,
		t: &Table{
			names:     make(map[string]*Name, len(f.Table)*4),
			wildcards: map[string]*Name{},
			ptr:       make(map[string][]dns.RR, len(f.Table)),
			bare:      map[string]*Name{},
			byNS:      make(map[nsKey]*Name, len(f.Table)),
			ents:      map[string]struct{}{},
			domain:    domain,
			ttl:       ttl,
		},
	}
	b.t.soa = b.newSOA(domain, opts.Serial)
	b.serial = opts.Serial
	if err := b.build(f); err != nil {
		return nil, err
	}
	return b.t, nil
}

type builder struct {
	domain, svc string
	ttl         uint32
	serial      uint32
	t           *Table

	// Slabs: a table holds millions of small objects; allocating them in
	// chunks keeps 100k-service builds fast and cheap for the GC.
	aSlab    slab[dns.A]
	aaaaSlab slab[dns.AAAA]
	rrSlab   slab[dns.RR]
	nameSlab slab[Name]
	hostSlab slab[Host]
	ipSlab   slab[byte]
}

// slab hands out sub-slices of large chunks.
type slab[T any] struct{ buf []T }

func (s *slab[T]) alloc(n int) []T {
	if len(s.buf) < n {
		s.buf = make([]T, max(n, 4096))
	}
	r := s.buf[:n:n]
	s.buf = s.buf[n:]
	return r
}

func (s *slab[T]) one() *T { return &s.alloc(1)[0] }

type parsedHost struct {
	key     string // as in the file
	name    string // lower case FQDN with dot
	v4, v6  []netip.Addr
	alts    []string
	ports   []HostPort
	k8s     bool
	short   string
	ns      string
	wild    bool
	autoVIP bool
}

func (b *builder) build(f *File) error {
	type entry struct {
		key  string
		info HostInfo
	}
	entries := make([]entry, 0, len(f.Table))
	for k, info := range f.Table {
		entries = append(entries, entry{k, info})
	}
	slices.SortFunc(entries, func(a, b entry) int { return strings.Compare(a.key, b.key) })

	parsed := make([]parsedHost, 0, len(entries))
	var reserved []netip.Addr
	var needVIP []int
	for i := range entries {
		p, err := b.parseHost(entries[i].key, &entries[i].info)
		if err != nil {
			return err
		}
		for _, a := range p.v4 {
			if vipPrefix4.Contains(a) {
				reserved = append(reserved, a)
			}
		}
		if len(p.v4)+len(p.v6) == 0 && !p.k8s && !p.wild {
			needVIP = append(needVIP, len(parsed))
		}
		parsed = append(parsed, p)
	}

	names := make([]string, len(needVIP))
	for i, idx := range needVIP {
		names[i] = parsed[idx].name
	}
	vips, err := allocateVIPs(names, reserved)
	if err != nil {
		return err
	}
	for i, idx := range needVIP {
		parsed[idx].v4 = []netip.Addr{vips[i].v4}
		parsed[idx].v6 = []netip.Addr{vips[i].v6}
		parsed[idx].autoVIP = true
	}

	// Pass 1: canonical names; they win over any alt name.
	hosts := make([]*Host, 0, len(parsed))
	kept := make([]*parsedHost, 0, len(parsed))
	for i := range parsed {
		p := &parsed[i]
		if len(p.v4)+len(p.v6) == 0 {
			b.t.skipped = append(b.t.skipped, p.key)
			continue
		}
		if prev := b.t.names[p.name]; prev != nil || (p.wild && b.t.wildcards[p.name[2:]] != nil) {
			return fmt.Errorf("table[%q]: same host as another entry (names are case-insensitive)", p.key)
		}
		h := b.newHost(p)
		hosts = append(hosts, h)
		kept = append(kept, p)
		b.insert(h.Name, h)
		if strings.HasSuffix(h.Name, "."+b.domain) {
			b.addENTs(h.Name)
		}
	}
	b.t.hosts = len(hosts)

	// Pass 2: alt names, first (sorted) host wins a collision.
	shortCount := map[string]int{}
	for i, h := range hosts {
		p := kept[i]
		for _, alt := range p.alts {
			if b.t.names[alt] == nil && !(strings.HasPrefix(alt, "*.") && b.t.wildcards[alt[2:]] != nil) {
				b.insert(alt, h)
			}
		}
		if p.k8s && p.short != "" && p.ns != "" && !h.Wildcard {
			label := p.short + "."
			k := nsKey{label, p.ns}
			if b.t.byNS[k] == nil {
				b.t.byNS[k] = b.newName(label, h)
				shortCount[label]++
			}
		}
	}
	for k, n := range b.t.byNS {
		if shortCount[k.label] == 1 && b.t.names[k.label] == nil {
			b.t.bare[k.label] = n
		}
	}

	// PTR records for every address, in sorted host order.
	for _, h := range hosts {
		if h.Wildcard {
			continue // never a "*" in a PTR target
		}
		for _, a := range h.V4 {
			b.addPTR(a, h)
		}
		for _, a := range h.V6 {
			b.addPTR(a, h)
		}
	}

	if len(f.Clients) > 0 {
		b.t.clients = make(map[netip.Addr]string, len(f.Clients))
		for ipStr, ns := range f.Clients {
			ip, err := netip.ParseAddr(ipStr)
			if err != nil || ip.Zone() != "" {
				return fmt.Errorf("clients[%q]: not an IP address", ipStr)
			}
			if ns == "" || strings.Contains(ns, ".") {
				return fmt.Errorf("clients[%q]: namespace %q is not a single DNS label", ipStr, ns)
			}
			b.t.clients[ip.Unmap()] = strings.ToLower(ns)
		}
	}
	b.t.ents[b.domain] = struct{}{}
	return nil
}

func (b *builder) parseHost(k string, info *HostInfo) (parsedHost, error) {
	p := parsedHost{key: k}
	name, err := normName(k)
	if err != nil {
		return p, fmt.Errorf("table[%q]: %w", k, err)
	}
	p.name = name
	p.wild = strings.HasPrefix(name, "*.")
	p.k8s = info.Registry == RegistryKubernetes
	if info.Registry != "" && !p.k8s && strings.EqualFold(info.Registry, RegistryKubernetes) {
		return p, fmt.Errorf("table[%q].registry: %q: did you mean %q?", k, info.Registry, RegistryKubernetes)
	}
	for i, s := range info.IPs {
		a, err := netip.ParseAddr(strings.TrimSpace(s))
		if err != nil || a.Zone() != "" {
			return p, fmt.Errorf("table[%q].ips[%d]: %q is not an IP address", k, i, s)
		}
		a = a.Unmap()
		if a.Is4() {
			if !slices.Contains(p.v4, a) {
				p.v4 = append(p.v4, a)
			}
		} else if !slices.Contains(p.v6, a) {
			p.v6 = append(p.v6, a)
		}
	}
	p.short = strings.ToLower(info.Shortname)
	p.ns = strings.ToLower(info.Namespace)
	for _, fld := range []struct{ n, v string }{{"shortname", p.short}, {"namespace", p.ns}} {
		if fld.v != "" && (strings.Contains(fld.v, ".") || !isLabel(fld.v)) {
			return p, fmt.Errorf("table[%q].%s: %q is not a single DNS label", k, fld.n, fld.v)
		}
	}
	if p.k8s && !p.wild && strings.HasSuffix(name, b.svc) {
		// <short>.<ns>.svc.<domain>.
		rest := strings.Split(strings.TrimSuffix(name, b.svc), ".")
		if len(rest) == 2 {
			if p.short == "" {
				p.short = rest[0]
			}
			if p.ns == "" {
				p.ns = rest[1]
			}
		}
		if p.short != "" && p.ns != "" {
			p.alts = append(p.alts, p.short+"."+p.ns+".", p.short+"."+p.ns+".svc.")
		}
	}
	for i, alt := range info.AltHosts {
		n, err := normName(alt)
		if err != nil {
			return p, fmt.Errorf("table[%q].altHosts[%d]: %w", k, i, err)
		}
		p.alts = append(p.alts, n)
	}
	for i, port := range info.Ports {
		hp, err := parsePort(port)
		if err != nil {
			return p, fmt.Errorf("table[%q].ports[%d]: %w", k, i, err)
		}
		p.ports = append(p.ports, hp)
	}
	return p, nil
}

func parsePort(port Port) (HostPort, error) {
	hp := HostPort{Name: strings.ToLower(port.Name)}
	if hp.Name == "" || strings.Contains(hp.Name, ".") || !isLabel(hp.Name) {
		return hp, fmt.Errorf("name: %q is not a single DNS label", port.Name)
	}
	if port.Port < 1 || port.Port > 65535 {
		return hp, fmt.Errorf("port: %d out of range 1-65535", port.Port)
	}
	hp.Port = uint16(port.Port)
	switch strings.ToUpper(port.Protocol) {
	case "", "TCP":
		hp.Protocol = "tcp"
	case "UDP":
		hp.Protocol = "udp"
	case "SCTP":
		hp.Protocol = "sctp"
	default:
		return hp, fmt.Errorf("protocol: %q is not TCP, UDP or SCTP", port.Protocol)
	}
	return hp, nil
}

// normName lower-cases a host name and adds the trailing dot. A wildcard is
// allowed only as the whole first label of a name with at least two labels.
func normName(s string) (string, error) {
	n := strings.ToLower(strings.TrimSpace(s))
	if n == "" || n == "." {
		return "", fmt.Errorf("empty host name")
	}
	if !strings.HasSuffix(n, ".") {
		n += "."
	}
	if _, ok := dns.IsDomainName(n); !ok {
		return "", fmt.Errorf("%q is not a domain name", s)
	}
	rest := n
	if strings.HasPrefix(n, "*.") {
		rest = n[2:]
		if strings.Count(rest, ".") < 2 {
			return "", fmt.Errorf("%q: a wildcard needs a parent of at least two labels", s)
		}
	}
	if strings.ContainsAny(rest, "*\\ ") {
		return "", fmt.Errorf("%q: '*' is only allowed as the whole first label; no escapes or spaces", s)
	}
	return n, nil
}

func isLabel(s string) bool {
	if len(s) == 0 || len(s) > 63 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

func (b *builder) newHost(p *parsedHost) *Host {
	h := b.hostSlab.one()
	*h = Host{
		Name:       p.name,
		Namespace:  p.ns,
		Shortname:  p.short,
		Kubernetes: p.k8s,
		Wildcard:   p.wild,
		AutoVIP:    p.autoVIP,
		V4:         p.v4,
		V6:         p.v6,
		Ports:      p.ports,
	}
	h.A, h.AAAA = b.addrRRs(h.Name, h)
	if strings.HasSuffix(h.Name, "."+b.domain) {
		h.SOA = b.t.soa
	} else {
		zone := h.Name
		if h.Wildcard {
			zone = zone[2:]
		}
		h.SOA = b.newSOA(zone, b.serial)
	}
	if !h.Wildcard {
		for i := range h.Ports {
			hp := &h.Ports[i]
			hp.SRV = b.srv("_"+hp.Name+"._"+hp.Protocol+"."+h.Name, h.Name, hp.Port)
			h.SRV = append(h.SRV, b.srv(h.Name, h.Name, hp.Port))
		}
	}
	return h
}

func (b *builder) srv(owner, target string, port uint16) *dns.SRV {
	return &dns.SRV{
		Hdr:      dns.RR_Header{Name: owner, Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: b.ttl},
		Priority: 0, Weight: 100, Port: port, Target: target,
	}
}

func (b *builder) addrRRs(owner string, h *Host) (a, aaaa []dns.RR) {
	if len(h.V4) > 0 {
		a = b.rrSlab.alloc(len(h.V4))
		recs := b.aSlab.alloc(len(h.V4))
		for i, ip := range h.V4 {
			ipb := b.ipSlab.alloc(4)
			a4 := ip.As4()
			copy(ipb, a4[:])
			recs[i] = dns.A{
				Hdr: dns.RR_Header{Name: owner, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: b.ttl},
				A:   ipb,
			}
			a[i] = &recs[i]
		}
	}
	if len(h.V6) > 0 {
		aaaa = b.rrSlab.alloc(len(h.V6))
		recs := b.aaaaSlab.alloc(len(h.V6))
		for i, ip := range h.V6 {
			ipb := b.ipSlab.alloc(16)
			a16 := ip.As16()
			copy(ipb, a16[:])
			recs[i] = dns.AAAA{
				Hdr:  dns.RR_Header{Name: owner, Rrtype: dns.TypeAAAA, Class: dns.ClassINET, Ttl: b.ttl},
				AAAA: ipb,
			}
			aaaa[i] = &recs[i]
		}
	}
	return a, aaaa
}

func (b *builder) newName(owner string, h *Host) *Name {
	n := b.nameSlab.one()
	*n = Name{Owner: owner, Host: h, A: h.A, AAAA: h.AAAA}
	if owner != h.Name {
		n.A, n.AAAA = b.addrRRs(owner, h)
	}
	return n
}

func (b *builder) insert(name string, h *Host) {
	if strings.HasPrefix(name, "*.") {
		b.t.wildcards[name[2:]] = b.newName(name, h)
		return
	}
	b.t.names[name] = b.newName(name, h)
}

// addENTs records the ancestors of name below and including the cluster
// domain as empty non-terminals.
func (b *builder) addENTs(name string) {
	for i := 0; i < len(name)-len(b.domain); i++ {
		if name[i] == '.' {
			anc := name[i+1:]
			if _, ok := b.t.ents[anc]; ok {
				return // every further ancestor is there already
			}
			b.t.ents[anc] = struct{}{}
		}
	}
}

func (b *builder) addPTR(a netip.Addr, h *Host) {
	rev := reverseName(a)
	b.t.ptr[rev] = append(b.t.ptr[rev], &dns.PTR{
		Hdr: dns.RR_Header{Name: rev, Rrtype: dns.TypePTR, Class: dns.ClassINET, Ttl: b.ttl},
		Ptr: h.Name,
	})
}

func (b *builder) newSOA(zone string, serial uint32) *dns.SOA {
	return &dns.SOA{
		Hdr:     dns.RR_Header{Name: zone, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: b.ttl},
		Ns:      "ns.dns." + b.domain,
		Mbox:    "hostmaster." + b.domain,
		Serial:  serial,
		Refresh: 7200,
		Retry:   1800,
		Expire:  86400,
		Minttl:  b.ttl,
	}
}

const hexDigits = "0123456789abcdef"

// reverseName returns the in-addr.arpa. or ip6.arpa. name of an address.
func reverseName(a netip.Addr) string {
	if a.Is4() {
		b := a.As4()
		buf := make([]byte, 0, 29)
		for i := 3; i >= 0; i-- {
			buf = strconv.AppendUint(buf, uint64(b[i]), 10)
			buf = append(buf, '.')
		}
		return string(append(buf, "in-addr.arpa."...))
	}
	b := a.As16()
	buf := make([]byte, 0, 72)
	for i := 15; i >= 0; i-- {
		buf = append(buf, hexDigits[b[i]&0xf], '.', hexDigits[b[i]>>4], '.')
	}
	return string(append(buf, "ip6.arpa."...))
}
