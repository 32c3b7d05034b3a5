package nametable

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/miekg/dns"
)

// Host is one host as a source contributes it to a Builder and as a table
// name resolves to it. A source fills the exported fields; the Builder
// copies and normalises the host and fills the unexported ones. Once in a
// published Table a Host is immutable.
//
// A table holds one Host per host, so its size is the table's size: what
// few hosts have lives in Extra, and the fields are ordered so that a Host
// takes one 160-byte size class (TestHostSize).
type Host struct {
	// Name is the canonical FQDN (any case, trailing dot optional);
	// "*.example.com" is a wildcard host.
	Name string
	// V4 and V6 are its addresses (v4-mapped v6 counts as v4).
	V4, V6 []netip.Addr
	// Ports are answered as SRV records.
	Ports []HostPort
	// Extra holds what few hosts have (an alias, more names, an
	// allocation order, a visibility); nil for none of it.
	Extra *HostExtra

	src  *sourceRec // the source that contributed the host (the winning one, for a merged host)
	key  string     // the source's object key
	soa  *dns.SOA   // of the host's zone, for a host outside the cluster domain
	self Name       // the entry of the canonical name, when it wins alone

	// Kubernetes marks a Kubernetes Service. A Kubernetes host named
	// <short>.<ns>.svc.<domain> also answers <short>.<ns>. and
	// <short>.<ns>.svc., and the bare <short>. (for clients of <ns>, or for
	// any client when only one namespace has that short name).
	Kubernetes bool
	// NeedVIP asks for an auto-allocated VIP pair (240.240.0.0/16 and
	// 2001:2::/48) when the host has no address and no CNAME: an external
	// host of resolution DNS.
	NeedVIP bool
	// Merge makes the same name from several sources answer the union of
	// their addresses and ports when the winning contribution also has
	// Merge (a headless Service's endpoints across clusters). Without it the
	// highest-priority source alone answers.
	Merge bool
	// NoPTR leaves the host's addresses out of reverse lookups.
	NoPTR bool

	// Filled by the Builder.

	// Wildcard is true for a "*." host.
	Wildcard bool
	// AutoVIP is true when V4 and V6 were allocated by the table.
	AutoVIP  bool
	inDomain bool  // under the cluster domain
	linked   bool  // has names in the table (false: no data, left out)
	shortLen uint8 // of a Kubernetes host named <short>.<ns>.svc.<domain>: len(<short>)
	nsLen    uint8 // and len(<ns>)
}

// HostExtra is what few hosts have. The Builder copies it before it
// normalises it: a source may share one HostExtra between hosts.
type HostExtra struct {
	// CNAME makes the host an alias (a Kubernetes ExternalName Service):
	// it is answered with a CNAME to this FQDN and has no addresses.
	CNAME string
	// AltNames are extra names that answer like the host.
	AltNames []string
	// Order sorts the hosts that get a VIP in the same batch (for example
	// a creation timestamp and UID, so that every node allocates in the
	// same order); ties and "" sort by name.
	Order string
	// Visible lists the client namespaces that see the host; nil means
	// every client. A client whose namespace is unknown sees only hosts
	// with a nil Visible.
	Visible []string
}

// CNAME is the host's alias target (Extra.CNAME), or "".
func (h *Host) CNAME() string {
	if h.Extra == nil {
		return ""
	}
	return h.Extra.CNAME
}

// AltNames are the host's extra names (Extra.AltNames).
func (h *Host) AltNames() []string {
	if h.Extra == nil {
		return nil
	}
	return h.Extra.AltNames
}

// Order is the host's VIP allocation order (Extra.Order), or "".
func (h *Host) Order() string {
	if h.Extra == nil {
		return ""
	}
	return h.Extra.Order
}

// Visible lists the namespaces that see the host (Extra.Visible); nil is
// every client.
func (h *Host) Visible() []string {
	if h.Extra == nil {
		return nil
	}
	return h.Extra.Visible
}

// Source is the name of the source that contributed the host (of the
// winning one, for a merged host); "" before a Builder took it.
func (h *Host) Source() string {
	if h.src == nil {
		return ""
	}
	return h.src.name
}

// sourceRec is a source a Builder knows: hosts point to it instead of each
// holding the name.
type sourceRec struct {
	name string
	prio int
}

// HostPort is a named port, answered as SRV _<name>._<protocol>.<host>.
type HostPort struct {
	Name     string // lower-case DNS label
	Protocol string // "tcp", "udp" or "sctp"
	Port     uint16
	// Target of the SRV record; "" is the host itself. A headless Service
	// has one entry per endpoint and port, each naming its endpoint.
	Target string
}

// Shortname is <short> of a Kubernetes host named <short>.<ns>.svc.<domain>,
// else "".
func (h *Host) Shortname() string { return h.Name[:h.shortLen] }

// Namespace is <ns> of a Kubernetes host named <short>.<ns>.svc.<domain>,
// else "".
func (h *Host) Namespace() string {
	if h.shortLen == 0 {
		return ""
	}
	i := int(h.shortLen) + 1
	return h.Name[i : i+int(h.nsLen)]
}

// shortLabel is "<short>." (a substring of the name: no allocation).
func (h *Host) shortLabel() string { return h.Name[:h.shortLen+1] }

// HasData reports whether the host has anything to answer: addresses or a
// CNAME.
func (h *Host) HasData() bool { return len(h.V4)+len(h.V6) > 0 || h.CNAME() != "" }

// VisibleTo reports whether a client of namespace ns sees the host; known
// is false when the client's namespace is unknown.
func (h *Host) VisibleTo(ns string, known bool) bool {
	vis := h.Visible()
	if vis == nil {
		return true
	}
	return known && slices.Contains(vis, ns)
}

// SRVTarget is the target of port p: its Target, or the host's name.
func (h *Host) SRVTarget(p *HostPort) string {
	if p.Target != "" {
		return p.Target
	}
	return h.Name
}

// NormName lower-cases a host name and adds the trailing dot. A wildcard is
// allowed only as the whole first label of a name with at least two more
// labels.
func NormName(s string) (string, error) {
	if isNormal(s) {
		return s, nil // the common case (sources build FQDNs): no allocation
	}
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

// isNormal reports whether s is already a lower-case FQDN of plain labels
// with the trailing dot, no wildcard.
func isNormal(s string) bool {
	if len(s) < 2 || len(s) > 254 || s[len(s)-1] != '.' {
		return false
	}
	label := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '.':
			if label == 0 || label > 63 {
				return false
			}
			label = 0
			continue
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_':
		default:
			return false
		}
		label++
	}
	return true
}

// isLabel reports whether s is one lower-case DNS label of letters, digits,
// '-' and '_'.
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

// normAddrs unmaps, de-duplicates and splits addresses by family, keeping
// their order.
func normAddrs(v4, v6 []netip.Addr) (o4, o6 []netip.Addr, err error) {
	if addrsNormal(v4, true) && addrsNormal(v6, false) {
		return v4, v6, nil // no copy
	}
	add := func(a netip.Addr) error {
		if !a.IsValid() || a.Zone() != "" {
			return fmt.Errorf("%q is not an IP address", a)
		}
		a = a.Unmap()
		if a.Is4() {
			if !slices.Contains(o4, a) {
				o4 = append(o4, a)
			}
		} else if !slices.Contains(o6, a) {
			o6 = append(o6, a)
		}
		return nil
	}
	for _, a := range v4 {
		if err := add(a); err != nil {
			return nil, nil, err
		}
	}
	for _, a := range v6 {
		if err := add(a); err != nil {
			return nil, nil, err
		}
	}
	return o4, o6, nil
}

// addrsNormal reports whether addrs are valid, unmapped, of the family and
// without duplicates.
func addrsNormal(addrs []netip.Addr, v4 bool) bool {
	for i, a := range addrs {
		if !a.IsValid() || a.Zone() != "" || a.Is4In6() || a.Is4() != v4 || slices.Contains(addrs[:i], a) {
			return false
		}
	}
	return true
}

// normalize checks and completes h (a copy the Builder owns).
func (b *Builder) normalize(h *Host) error {
	n, err := NormName(h.Name)
	if err != nil {
		return err
	}
	h.Name = n
	h.Wildcard = strings.HasPrefix(n, "*.")
	h.inDomain = strings.HasSuffix(n, "."+b.domain) || n == b.domain
	if h.V4, h.V6, err = normAddrs(h.V4, h.V6); err != nil {
		return err
	}
	if err := normExtra(h); err != nil {
		return err
	}
	h.AutoVIP = false
	h.shortLen, h.nsLen = 0, 0
	if h.Kubernetes && !h.Wildcard && strings.HasSuffix(n, b.svc) {
		head := n[:len(n)-len(b.svc)] // "<short>.<ns>"
		if i := strings.IndexByte(head, '.'); i > 0 && i < len(head)-1 && strings.IndexByte(head[i+1:], '.') < 0 {
			h.shortLen, h.nsLen = uint8(i), uint8(len(head)-i-1)
		}
	}
	if len(h.Ports) > 0 && !portsNormal(h.Ports) {
		ports := make([]HostPort, len(h.Ports))
		for i, p := range h.Ports {
			p.Name = strings.ToLower(p.Name)
			if !isLabel(p.Name) {
				return fmt.Errorf("ports[%d]: name %q is not a single DNS label", i, p.Name)
			}
			switch p.Protocol = strings.ToLower(p.Protocol); p.Protocol {
			case "":
				p.Protocol = "tcp"
			case "tcp", "udp", "sctp":
			default:
				return fmt.Errorf("ports[%d]: protocol %q is not TCP, UDP or SCTP", i, p.Protocol)
			}
			if p.Port == 0 {
				return fmt.Errorf("ports[%d]: port 0", i)
			}
			if p.Target != "" {
				if p.Target, err = NormName(p.Target); err != nil {
					return fmt.Errorf("ports[%d]: target: %w", i, err)
				}
			}
			ports[i] = p
		}
		h.Ports = ports
	}
	return nil
}

// normExtra checks and normalises a copy of h.Extra (the source's stays as
// it is); an Extra with nothing in it is dropped. h.Name is normal.
func normExtra(h *Host) error {
	if h.Extra == nil {
		return nil
	}
	x := *h.Extra
	if x.CNAME != "" {
		var err error
		if x.CNAME, err = NormName(x.CNAME); err != nil {
			return fmt.Errorf("cname: %w", err)
		}
		if strings.HasPrefix(x.CNAME, "*.") {
			return fmt.Errorf("cname %q: not a wildcard", x.CNAME)
		}
		if len(h.V4)+len(h.V6) > 0 {
			return fmt.Errorf("a CNAME host has no addresses")
		}
	}
	if len(x.AltNames) > 0 {
		alts := make([]string, 0, len(x.AltNames))
		for i, a := range x.AltNames {
			an, err := NormName(a)
			if err != nil {
				return fmt.Errorf("altNames[%d]: %w", i, err)
			}
			if an != h.Name && !slices.Contains(alts, an) {
				alts = append(alts, an)
			}
		}
		x.AltNames = alts
	}
	if len(x.AltNames) == 0 {
		x.AltNames = nil
	}
	if x.Visible != nil {
		vis := slices.Clone(x.Visible)
		for i := range vis {
			vis[i] = strings.ToLower(vis[i])
		}
		slices.Sort(vis)
		x.Visible = slices.Compact(vis)
	}
	if x.CNAME == "" && x.AltNames == nil && x.Order == "" && x.Visible == nil {
		h.Extra = nil
		return nil
	}
	h.Extra = &x
	return nil
}

// portsNormal reports whether ports need no change (lower-case labels,
// protocol given, targets normal).
func portsNormal(ports []HostPort) bool {
	for _, p := range ports {
		if !isLabel(p.Name) || p.Port == 0 || (p.Protocol != "tcp" && p.Protocol != "udp" && p.Protocol != "sctp") ||
			(p.Target != "" && !isNormal(p.Target)) {
			return false
		}
	}
	return true
}

// sameHost reports whether two normalised hosts answer the same, so that an
// update that does not change a host leaves the table alone.
func sameHost(a, b *Host) bool {
	return a.Name == b.Name && a.Kubernetes == b.Kubernetes && a.NeedVIP == b.NeedVIP && a.Merge == b.Merge &&
		a.NoPTR == b.NoPTR && sameAddrs(a, b) && slices.Equal(a.Ports, b.Ports) && sameExtra(a.Extra, b.Extra)
}

// sameExtra compares two normalised Extras (nil: none).
func sameExtra(a, b *HostExtra) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.CNAME == b.CNAME && a.Order == b.Order && slices.Equal(a.AltNames, b.AltNames) &&
		slices.Equal(a.Visible, b.Visible) && (a.Visible == nil) == (b.Visible == nil)
}

// sameAddrs compares the addresses of an old host a with a new host b; a
// VIP a got from the table counts as equal to b asking for one.
func sameAddrs(a, b *Host) bool {
	if a.AutoVIP {
		return b.NeedVIP && len(b.V4)+len(b.V6) == 0 && b.CNAME() == ""
	}
	return slices.Equal(a.V4, b.V4) && slices.Equal(a.V6, b.V6)
}
