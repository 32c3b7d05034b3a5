package resolver

import (
	"net/netip"
	"strings"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// The decide step: one question (lower-cased name, type, the client's address) and
// one table snapshot in, one decision out. It is the only place the query path looks
// anything up in the table: the PTR, exact and wildcard names, pod records, SRV port
// names, autopath (also for external names), aliases followed inside the table,
// namespace visibility and search paths (through the client), the authoritative
// NXDOMAIN/NODATA and the AAAA filter. The wire encoder (encode_wire.go) and the
// dns.Msg encoder (encode_msg.go) only render a decision; when the wire encoder
// declines one, the dns.Msg encoder renders the same value.

// maxChain bounds the CNAME records of a decision: an autopath expansion, the alias,
// and at most 8 aliases followed inside the table.
const maxChain = 10

// link is one CNAME record of a decision; owner "" is the question's name (rendered
// in the client's spelling).
type link struct{ owner, target string }

// srvTarget is an SRV target and the host whose addresses go in the additional
// section for it.
type srvTarget struct {
	name string
	host *nametable.Host
}

// decision is the answer to one question. Records owned by the question are
// rendered with the client's spelling of it; the host's records are owned by the
// last CNAME target, or by the question without one.
type decision struct {
	t *nametable.Table // the snapshot decided from (nil: not loaded yet)

	rcode    int
	aa       bool
	autopath bool   // a search-path expansion (source and tap "autopath")
	chain    []link // the CNAME records, in order (worker scratch)

	host  *nametable.Host // whose records answer
	addrs bool            // the host's addresses of the question's type (A, AAAA, ANY both)
	srv   bool            // the host's SRV records (more says which)
	more  *decisionMore   // PTR, pod record and SRV details (nil: none; the common answer needs none)

	soa       *dns.SOA // a negative answer's SOA (authority section)
	soaAnswer bool     // ... in the answer section instead (SOA of the cluster domain)

	forward  bool   // the rest is the upstream's: forward fwd
	fwd      string // the name to forward (the question's, an alias target, an external name)
	filtered bool   // the AAAA filter: the forwarded part is NODATA with soa instead
}

// decisionMore is the part of a decision that only the dns.Msg encoder renders.
type decisionMore struct {
	pod netip.Addr // a pod record's address, owned by the question
	ptr []string   // PTR targets, owned by the question

	self                string // the target of an SRV record of a port without its own
	portName, portProto string // only this port's SRV record ("": every port)
	extra               []srvTarget
}

// decide makes r's decision in d, a zero decision (the caller's, on its stack: not
// zeroed twice); the chain is kept in the worker's storage, valid until the next
// query. It takes one table snapshot: every lookup of the query is in it. The rules
// run in the order of docs/resolver.md.
func (w *worker) decide(r *request, d *decision) {
	s := w.s
	w.decided++
	d.chain = w.chain[:0]
	t := s.tables.Table()
	d.t = t
	if t == nil {
		d.forward, d.fwd = true, r.lname // not loaded yet: forward rather than fail
		return
	}
	name, qtype, client := r.lname, r.qtype, r.client.addr
	if qtype == dns.TypePTR {
		if targets := t.PTR(name); targets != nil {
			d.aa, d.more = true, &decisionMore{ptr: targets}
			return
		}
	}
	if n, wild := t.Find(name, client); n != nil {
		s.decideName(d, t, r, n, wild)
		return
	}
	if s.podRecords && strings.HasSuffix(name, s.dotPod) && s.decidePod(d, t, qtype, name) {
		return
	}
	if strings.HasPrefix(name, "_") && (qtype == dns.TypeSRV || qtype == dns.TypeANY) && s.decideSRV(d, t, name, client) {
		return
	}
	expanded := false // a table name by a search suffix
	if s.autopathCandidate(name) {
		n, target, _ := s.autopathTarget(t, name, client)
		expanded = n != nil
		switch qtype {
		case dns.TypeA, dns.TypeAAAA, dns.TypeSRV, dns.TypeANY, dns.TypeCNAME:
			if n != nil {
				s.decideAutopath(d, t, qtype, n, target, client)
				return
			}
		}
	}
	if !expanded {
		if ext, ok := s.externalAutopath(t, name, client); ok {
			d.autopath = true
			d.chain = append(d.chain, link{target: ext})
			s.forwardTo(d, t, qtype, ext)
			return
		}
	}
	if s.authoritative && s.underDomain(name) {
		d.aa, d.soa = true, t.DomainSOA()
		if !t.IsEmptyNonTerminal(name) {
			d.rcode = dns.RcodeNameError
		} else if qtype == dns.TypeSOA && name == s.domain {
			d.soaAnswer = true
		}
		return
	}
	s.forwardTo(d, t, qtype, name)
}

// forwardTo decides to forward name: the upstream answers the rest, or with the AAAA
// filter an AAAA question is answered NODATA (with the cluster domain's SOA) instead.
func (s *Server) forwardTo(d *decision, t *nametable.Table, qtype uint16, name string) {
	d.forward, d.fwd = true, name
	if s.filterAAAA && qtype == dns.TypeAAAA {
		d.filtered, d.soa = true, t.DomainSOA()
	}
}

// underDomain reports whether name is the cluster domain or under it. A name under it
// ends in the domain's own labels, which need no escapes; a name with escapes (only the
// unpacked decoder lets them through: in x\.cluster.local. the first label is
// "x.cluster") is then compared label by label.
func (s *Server) underDomain(name string) bool {
	if !strings.HasSuffix(name, s.dotDomain) && name != s.domain {
		return false
	}
	return strings.IndexByte(name, '\\') < 0 || dns.IsSubDomain(s.domain, name)
}

// decideName decides r's question for a name the table knows (wild: by a wildcard,
// whose records the question's name owns).
func (s *Server) decideName(d *decision, t *nametable.Table, r *request, n *nametable.Name, wild bool) {
	qtype := r.qtype
	d.aa = true
	h := n.Host
	if h.CNAME() != "" {
		s.decideAlias(d, t, qtype, "", h, r.client.addr)
		return
	}
	d.host = h
	empty := true
	switch qtype {
	case dns.TypeA:
		d.addrs, empty = true, len(h.V4) == 0
	case dns.TypeAAAA:
		d.addrs, empty = true, len(h.V6) == 0
	case dns.TypeANY:
		d.addrs, empty = true, len(h.V4) == 0 && len(h.V6) == 0
	case dns.TypeSRV:
		m := &decisionMore{self: h.Name}
		if wild {
			m.self = r.lname
		}
		m.extra = srvExtra(t, h, m.self, "", "", r.client.addr)
		d.srv, d.more, empty = true, m, len(h.Ports) == 0
	}
	if empty {
		d.soa = t.SOA(h)
	}
}

// decideAlias adds owner's CNAME to alias host h's target and follows aliases inside
// the table (at most 8). A final target the table knows answers with its addresses;
// one under the cluster domain that it does not know is NXDOMAIN (authoritative);
// anything else is forwarded behind the chain.
func (s *Server) decideAlias(d *decision, t *nametable.Table, qtype uint16, owner string, h *nametable.Host, client netip.Addr) {
	target := h.CNAME()
	d.chain = append(d.chain, link{owner, target})
	if qtype == dns.TypeCNAME {
		return
	}
	for range 8 {
		tn, _ := t.Find(target, client)
		if tn == nil {
			break
		}
		if next := tn.Host.CNAME(); next != "" {
			d.chain = append(d.chain, link{target, next})
			target = next
			continue
		}
		d.host = tn.Host
		d.addrs = qtype == dns.TypeA || qtype == dns.TypeAAAA || qtype == dns.TypeANY
		return
	}
	if s.authoritative && dns.IsSubDomain(s.domain, target) {
		d.rcode, d.soa = dns.RcodeNameError, t.DomainSOA()
		return
	}
	s.forwardTo(d, t, qtype, target)
}

// decidePod decides <a-b-c-d>.<ns>.pod.<domain> (and the dashed IPv6 form): the
// address in the name, as CoreDNS's "pods insecure" does.
func (s *Server) decidePod(d *decision, t *nametable.Table, qtype uint16, lname string) bool {
	head := lname[:len(lname)-len(s.dotPod)] // "<ip>.<ns>"
	i := strings.IndexByte(head, '.')
	if i <= 0 || strings.IndexByte(head[i+1:], '.') >= 0 {
		return false
	}
	ipLabel := head[:i]
	var ip netip.Addr
	var err error
	if strings.Count(ipLabel, "-") == 3 && !strings.Contains(ipLabel, "--") {
		ip, err = netip.ParseAddr(strings.ReplaceAll(ipLabel, "-", "."))
	} else {
		ip, err = netip.ParseAddr(strings.ReplaceAll(ipLabel, "-", ":"))
	}
	if err != nil {
		return false
	}
	d.aa = true
	ip = ip.Unmap()
	switch {
	case ip.Is4() && (qtype == dns.TypeA || qtype == dns.TypeANY), ip.Is6() && (qtype == dns.TypeAAAA || qtype == dns.TypeANY):
		d.more = &decisionMore{pod: ip}
	default:
		d.soa = t.DomainSOA()
	}
	return true
}

// decideSRV decides _port._proto.<name> for a known name with that port.
func (s *Server) decideSRV(d *decision, t *nametable.Table, lname string, client netip.Addr) bool {
	i := strings.IndexByte(lname, '.')
	if i < 0 || i+1 >= len(lname) || lname[i+1] != '_' {
		return false
	}
	j := strings.IndexByte(lname[i+1:], '.')
	if j < 0 {
		return false
	}
	portName, protoName, rest := lname[1:i], lname[i+2:i+1+j], lname[i+1+j+1:]
	n, wild := t.Find(rest, client)
	if n == nil || !hasPort(n.Host, portName, protoName) {
		return false
	}
	m := &decisionMore{self: n.Host.Name, portName: portName, portProto: protoName}
	if wild {
		m.self = rest
	}
	m.extra = srvExtra(t, n.Host, m.self, portName, protoName, client)
	d.aa, d.srv, d.host, d.more = true, true, n.Host, m
	return true
}

// decideAutopath decides a search-path expansion of table name n: a CNAME from the
// question to target, then the host's records (or its alias's).
func (s *Server) decideAutopath(d *decision, t *nametable.Table, qtype uint16, n *nametable.Name, target string, client netip.Addr) {
	h := n.Host
	d.autopath, d.aa = true, true
	d.chain = append(d.chain, link{target: target})
	if h.CNAME() != "" {
		s.decideAlias(d, t, qtype, target, h, client)
		return
	}
	d.host = h
	switch qtype {
	case dns.TypeA, dns.TypeAAAA, dns.TypeANY:
		d.addrs = true
	case dns.TypeSRV:
		d.srv, d.more = true, &decisionMore{self: target, extra: srvExtra(t, h, target, "", "", client)}
	}
}

// hasPort reports whether h has the port portName/proto.
func hasPort(h *nametable.Host, portName, proto string) bool {
	for i := range h.Ports {
		if p := &h.Ports[i]; p.Name == portName && p.Protocol == proto {
			return true
		}
	}
	return false
}

// srvExtra is the SRV targets of h's ports (portName and proto, or every port for
// ""), each with the host whose addresses go in the additional section (self is h);
// a target the table does not know has none.
func srvExtra(t *nametable.Table, h *nametable.Host, self, portName, proto string, client netip.Addr) []srvTarget {
	var out []srvTarget
	for i := range h.Ports {
		p := &h.Ports[i]
		if portName != "" && (p.Name != portName || p.Protocol != proto) {
			continue
		}
		target := self
		if p.Target != "" {
			target = p.Target
		}
		if containsTarget(out, target) {
			continue
		}
		th := h
		if target != self {
			tn, _ := t.Find(target, client)
			if tn == nil {
				out = append(out, srvTarget{name: target})
				continue
			}
			th = tn.Host
		}
		out = append(out, srvTarget{target, th})
	}
	return out
}

func containsTarget(ts []srvTarget, name string) bool {
	for _, t := range ts {
		if t.name == name {
			return true
		}
	}
	return false
}

// autopathCandidate is a cheap pre-check (no allocation) that the name
// ends in the cluster domain or a search domain.
func (s *Server) autopathCandidate(lname string) bool {
	if strings.HasSuffix(lname, s.dotDomain) {
		return true
	}
	for _, sd := range s.dotSearch {
		if strings.HasSuffix(lname, sd) {
			return true
		}
	}
	return false
}

// autopathTarget finds the table name a search-list expansion stands for.
// It strips, in this order, a trailing <label>.svc.<domain>.,
// svc.<domain>., <domain>. or a configured search domain, and looks up what
// remains when it has at least two labels (a single label is never
// autopathed: <short>.<ns>.svc.<domain> is a real name, answered exactly or
// not at all). target is the CNAME target: the host's canonical name, or
// the remaining name for a wildcard host (never a literal "*").
func (s *Server) autopathTarget(t *nametable.Table, lname string, client netip.Addr) (n *nametable.Name, target string, wild bool) {
	try := func(rest string) bool {
		if strings.Count(rest, ".") < 2 {
			return false
		}
		n, wild = t.Find(rest, client)
		if n == nil {
			return false
		}
		target = n.Host.Name
		if wild {
			target = rest
		}
		return true
	}
	if strings.HasSuffix(lname, s.dotDomain) {
		head := lname[:len(lname)-len(s.domain)] // "...svc." or "...<x>."
		if strings.HasSuffix(head, ".svc.") {
			pre := head[:len(head)-len("svc.")] // "rest.<label>."
			if i := strings.LastIndexByte(pre[:len(pre)-1], '.'); i >= 0 && try(pre[:i+1]) {
				return n, target, wild
			}
			if try(pre) {
				return n, target, wild
			}
		}
		if try(head) {
			return n, target, wild
		}
	}
	for _, sd := range s.dotSearch {
		if strings.HasSuffix(lname, sd) && try(lname[:len(lname)-len(sd)+1]) {
			return n, target, wild
		}
	}
	return nil, "", false
}

// externalAutopath finds the external name that a client's first search suffix
// expanded: for a client whose namespace the table knows, <x>.<ns>.svc.<domain> with
// x of at least two labels, outside the cluster domain and not in the table, stands for
// x (glibc and musl try that suffix first with ndots:5). It is answered with a CNAME to
// x and x's upstream answer in one round trip, as CoreDNS's autopath does. Only when
// the resolver is authoritative for the cluster domain: otherwise the expanded name
// might exist upstream.
func (s *Server) externalAutopath(t *nametable.Table, lname string, client netip.Addr) (string, bool) {
	if !s.authoritative || !strings.HasSuffix(lname, s.dotDomain) {
		return "", false
	}
	ns, ok := t.ClientNamespace(client)
	if !ok {
		return "", false
	}
	head := lname[:len(lname)-len(s.domain)] // "x.<ns>.svc."
	suffix := len(ns) + len(".svc.")
	if len(head) <= suffix+1 || head[len(head)-suffix-1] != '.' || !strings.HasSuffix(head, ".svc.") ||
		head[len(head)-suffix:len(head)-len(".svc.")] != ns {
		return "", false
	}
	x := head[:len(head)-suffix]
	if strings.Count(x, ".") < 2 || x == s.domain || strings.HasSuffix(x, s.dotDomain) {
		return "", false
	}
	if n, _ := t.Find(x, client); n != nil {
		return "", false
	}
	return x, true
}
