package nametable

import (
	"net/netip"
	"strings"
	"time"
	"unsafe"

	"github.com/miekg/dns"
)

// DefaultTTL is the TTL of table answers when Options.TTL is zero.
const DefaultTTL = 30 * time.Second

// DefaultClusterDomain is used when Options.ClusterDomain is empty.
const DefaultClusterDomain = "cluster.local"

// Options control how hosts become a Table.
type Options struct {
	// ClusterDomain is the Kubernetes cluster domain (default cluster.local).
	ClusterDomain string
	// TTL of answers and of the negative-answer SOA (default 30s).
	TTL time.Duration
}

func (o Options) withDefaults() Options {
	if o.ClusterDomain == "" {
		o.ClusterDomain = DefaultClusterDomain
	}
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	return o
}

// Name is one queryable name's entry.
type Name struct {
	Host *Host
	// next is the same name as another host sees it, for clients that do
	// not see Host (see Host.Visible).
	next *Name
}

type nsKey struct{ label, ns string }

// Table is an immutable lookup snapshot published by a Builder. All methods
// are safe for concurrent use and take no locks.
type Table struct {
	names     smap[string, *Name]
	wildcards smap[string, *Name]     // key: the parent of "*.", e.g. "example.com."
	ptr       smap[addrKey, ptrNames] // address -> host names
	bare      smap[string, *Name]     // unambiguous bare Kubernetes short names, key "reviews."
	ents      smap[string, struct{}]  // empty non-terminals under the domain
	clients   map[netip.Addr]string   // client IP -> namespace
	hosts     int
	skipped   int
	domain    string // "cluster.local."
	svc       string // ".svc.cluster.local."
	ttl       uint32
	soa       *dns.SOA
	serial    uint32
}

// Len is the number of hosts with names in the table.
func (t *Table) Len() int { return t.hosts }

// Skipped is the number of hosts left out because they have nothing to
// answer (no address and no CNAME, such as a headless Service without
// ready endpoints); their names are not in the table.
func (t *Table) Skipped() int { return t.skipped }

// Serial counts the tables a Builder has published; it is the serial of
// the cluster domain's SOA.
func (t *Table) Serial() uint32 { return t.serial }

// Domain is the cluster domain, lower case with trailing dot.
func (t *Table) Domain() string { return t.domain }

// TTL is the TTL in seconds of table answers.
func (t *Table) TTL() uint32 { return t.ttl }

// DomainSOA is the SOA of the cluster domain, used for NXDOMAIN answers.
func (t *Table) DomainSOA() *dns.SOA { return t.soa }

// SOA is the SOA to put in the authority section of a NODATA answer for h:
// the cluster domain's for hosts under it, else one for the host's zone.
func (t *Table) SOA(h *Host) *dns.SOA {
	if h.inDomain || h.soa == nil {
		return t.soa
	}
	return h.soa
}

// Lookup returns the entry stored under the exact lower-case name as a
// client that sees every host sees it.
func (t *Table) Lookup(name string) *Name {
	n, _ := t.names.get(name)
	return n
}

// PTR returns the host names of a lower-case reverse name
// (x.x.x.x.in-addr.arpa. or nibbles.ip6.arpa.), sorted.
func (t *Table) PTR(name string) []string {
	a, ok := parseReverse(name)
	if !ok {
		return nil
	}
	v, _ := t.ptr.get(keyOf(a))
	return v.list()
}

// ptrNames are the sorted host names of one address in one string,
// separated by ptrSep (a space: NormName rejects it in names): a map value
// of one string header.
type ptrNames string

const ptrSep = " "

func newPtrNames(names []string) ptrNames { return ptrNames(strings.Join(names, ptrSep)) }

func (p ptrNames) list() []string {
	if p == "" {
		return nil
	}
	return strings.Split(string(p), ptrSep)
}

// IsEmptyNonTerminal reports whether a lower-case name under the cluster
// domain exists only as the parent of table names (such as svc.<domain>.
// or <ns>.svc.<domain>.): NODATA, not NXDOMAIN.
func (t *Table) IsEmptyNonTerminal(name string) bool {
	if name == t.domain {
		return true
	}
	_, ok := t.ents.get(name)
	return ok
}

// ClientNamespace returns the namespace of a client pod IP, if a source
// knows it.
func (t *Table) ClientNamespace(ip netip.Addr) (string, bool) {
	if len(t.clients) == 0 {
		return "", false
	}
	ns, ok := t.clients[ip.Unmap()]
	return ns, ok
}

// visible returns the first entry of the chain n the client sees.
func (t *Table) visible(n *Name, client netip.Addr, ns string, known, looked bool) *Name {
	for ; n != nil; n = n.next {
		if n.Host.Visible() == nil {
			return n
		}
		if !looked {
			ns, known = t.ClientNamespace(client)
			looked = true
		}
		if n.Host.VisibleTo(ns, known) {
			return n
		}
	}
	return nil
}

// Find resolves a lower-case FQDN for a client: an exact name; then the
// short forms of a Kubernetes Service (<short>.<ns>. and <short>.<ns>.svc.;
// a bare <short>. in the client's namespace when the client is known, else
// in the only namespace that has it); then the closest enclosing wildcard.
// wildcard reports that the answer records must carry the queried name.
// Hosts the client does not see (Host.Visible) are skipped.
func (t *Table) Find(name string, client netip.Addr) (n *Name, wildcard bool) {
	if e, ok := t.names.get(name); ok {
		if v := t.visible(e, client, "", false, false); v != nil {
			return v, false
		}
	}
	switch dots := strings.Count(name, "."); {
	case dots == 1 && len(name) > 1:
		ns, known := t.ClientNamespace(client)
		if known {
			return t.kubeShort(name, ns), false
		}
		if e, ok := t.bare.get(name); ok {
			return e, false
		}
		return nil, false
	case dots == 2:
		if n := t.kubeShort(name, ""); n != nil {
			return n, false
		}
	case dots == 3 && strings.HasSuffix(name, ".svc."):
		if n := t.kubeShort(name[:len(name)-len("svc.")], ""); n != nil {
			return n, false
		}
	}
	if t.wildcards.len() == 0 {
		return nil, false
	}
	for i := 0; i < len(name)-1; i++ {
		if name[i] == '.' {
			if e, ok := t.wildcards.get(name[i+1:]); ok {
				if v := t.visible(e, client, "", false, false); v != nil {
					return v, true
				}
			}
		}
	}
	return nil, false
}

// kubeShort looks up the Kubernetes Service <head><ns>.svc.<domain>, where
// head is "<short>." (ns given) or "<short>.<ns>." (ns empty), without
// allocating.
func (t *Table) kubeShort(head, ns string) *Name {
	var buf [256]byte
	n := copy(buf[:], head)
	if ns != "" {
		n += copy(buf[n:], ns)
		if n < len(buf) {
			buf[n] = '.'
			n++
		}
	}
	n += copy(buf[n:], t.svc[1:])
	if n >= len(buf) {
		return nil
	}
	full := unsafe.String(&buf[0], n)
	e, ok := t.names.get(full)
	if !ok || !e.Host.Kubernetes || e.Host.shortLen == 0 {
		return nil
	}
	// Only hosts whose canonical name this is (not an alt name).
	if len(e.Host.Name) != n {
		return nil
	}
	return e
}

// Each calls fn for every entry of the table (every name and wildcard,
// each visibility variant) with the lower-case name it is stored under,
// until fn returns false. For listings, not for the query path.
func (t *Table) Each(fn func(owner string, n *Name) bool) {
	cont := true
	visit := func(owner string, e *Name) bool {
		for ; e != nil && cont; e = e.next {
			cont = fn(owner, e)
		}
		return cont
	}
	t.names.each(visit)
	if cont {
		t.wildcards.each(func(parent string, e *Name) bool { return visit("*."+parent, e) })
	}
}

// Clients returns a copy of the client IP -> namespace map.
func (t *Table) Clients() map[netip.Addr]string {
	out := make(map[netip.Addr]string, len(t.clients))
	for k, v := range t.clients {
		out[k] = v
	}
	return out
}

// parseReverse parses a lower-case reverse name into its address.
func parseReverse(name string) (netip.Addr, bool) {
	switch {
	case strings.HasSuffix(name, ".in-addr.arpa."):
		s := name[:len(name)-len(".in-addr.arpa.")]
		var b [4]byte
		for i := 3; i >= 0; i-- {
			j := strings.IndexByte(s, '.')
			part := s
			if i > 0 {
				if j < 0 {
					return netip.Addr{}, false
				}
				part, s = s[:j], s[j+1:]
			} else if j >= 0 {
				return netip.Addr{}, false
			}
			v := 0
			if len(part) == 0 || len(part) > 3 || (len(part) > 1 && part[0] == '0') {
				return netip.Addr{}, false
			}
			for k := 0; k < len(part); k++ {
				c := part[k]
				if c < '0' || c > '9' {
					return netip.Addr{}, false
				}
				v = v*10 + int(c-'0')
			}
			if v > 255 {
				return netip.Addr{}, false
			}
			b[i] = byte(v)
		}
		return netip.AddrFrom4(b), true
	case strings.HasSuffix(name, ".ip6.arpa."):
		s := name[:len(name)-len(".ip6.arpa.")]
		if len(s) != 63 {
			return netip.Addr{}, false
		}
		var b [16]byte
		for i := 0; i < 32; i++ {
			c := s[i*2]
			if i < 31 && s[i*2+1] != '.' {
				return netip.Addr{}, false
			}
			var v byte
			switch {
			case c >= '0' && c <= '9':
				v = c - '0'
			case c >= 'a' && c <= 'f':
				v = c - 'a' + 10
			default:
				return netip.Addr{}, false
			}
			// nibble i counts from the least significant end
			pos := 31 - i
			if pos%2 == 0 {
				b[pos/2] |= v << 4
			} else {
				b[pos/2] |= v
			}
		}
		return netip.AddrFrom16(b), true
	}
	return netip.Addr{}, false
}

const hexDigits = "0123456789abcdef"

// ReverseName returns the in-addr.arpa. or ip6.arpa. name of an address.
func ReverseName(a netip.Addr) string {
	a = a.Unmap()
	if a.Is4() {
		b := a.As4()
		buf := make([]byte, 0, 29)
		for i := 3; i >= 0; i-- {
			buf = appendUint8(buf, b[i])
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

func appendUint8(b []byte, v byte) []byte {
	if v >= 100 {
		b = append(b, '0'+v/100)
	}
	if v >= 10 {
		b = append(b, '0'+v/10%10)
	}
	return append(b, '0'+v%10)
}
