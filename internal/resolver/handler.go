package resolver

import (
	"math/rand/v2"
	"net/netip"
	"strings"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/nametable"
)

// ourUDPSize is the UDP payload size we advertise in our OPT records.
const ourUDPSize = 1232

func newOPT(do bool) *dns.OPT {
	o := &dns.OPT{Hdr: dns.RR_Header{Name: ".", Rrtype: dns.TypeOPT}}
	o.SetUDPSize(ourUDPSize)
	if do {
		o.SetDo()
	}
	return o
}

// reqInfo is what the handler needs to know about a request besides the
// message.
type reqInfo struct {
	proto  proto
	client netip.Addr
	opt    *dns.OPT // client's OPT, nil without EDNS
}

// sizeLimit is the largest response the client can take.
func (ri *reqInfo) sizeLimit() int {
	if ri.proto == protoTCP {
		return dns.MaxMsgSize
	}
	if ri.opt == nil {
		return dns.MinMsgSize
	}
	return min(max(int(ri.opt.UDPSize()), dns.MinMsgSize), maxUDPResponse)
}

// local answers what can be answered without the forwarder. It returns
// resp == nil with forward == true when the query must be forwarded, and
// resp == nil with forward == false when the packet must not be answered
// (a FORMERR response sent to us: answering it could loop).
func (s *Server) local(req *dns.Msg, ri *reqInfo) (resp *dns.Msg, forward bool) {
	resp = new(dns.Msg)
	resp.Id = req.Id
	resp.Response = true
	resp.Opcode = req.Opcode
	resp.RecursionAvailable = true
	resp.RecursionDesired = req.RecursionDesired
	resp.CheckingDisabled = req.CheckingDisabled
	if len(req.Question) == 1 {
		resp.Question = req.Question
	}
	if req.Response {
		if req.Rcode == dns.RcodeFormatError {
			return nil, false
		}
		resp.Rcode = dns.RcodeFormatError
		return resp, false
	}
	if req.Opcode != dns.OpcodeQuery {
		resp.Rcode = dns.RcodeNotImplemented
		return resp, false
	}
	nopt := 0
	for _, rr := range req.Extra {
		if o, ok := rr.(*dns.OPT); ok {
			ri.opt = o
			nopt++
		}
	}
	if nopt > 1 {
		ri.opt = nil // RFC 6891 6.1.1: more than one OPT is FORMERR, no OPT back
	}
	if nopt > 1 || len(req.Question) != 1 {
		resp.Rcode = dns.RcodeFormatError
		return resp, false
	}
	if ri.opt != nil && ri.opt.Version() != 0 {
		resp.Rcode = dns.RcodeBadVers
		return resp, false
	}
	q := &req.Question[0]
	switch {
	case q.Qclass == dns.ClassCHAOS:
		return s.chaos(resp, q), false
	case q.Qclass != dns.ClassINET:
		resp.Rcode = dns.RcodeRefused
		return resp, false
	}
	switch q.Qtype {
	case dns.TypeOPT, dns.TypeTSIG, dns.TypeTKEY:
		resp.Rcode = dns.RcodeFormatError
		return resp, false
	case dns.TypeAXFR, dns.TypeIXFR:
		resp.Rcode = dns.RcodeRefused
		return resp, false
	}
	t := s.tables.Table()
	if t == nil {
		return nil, true // not loaded yet: forward rather than fail
	}
	name := strings.ToLower(q.Name)
	if q.Qtype == dns.TypePTR {
		if ptr := t.LookupPTR(name); ptr != nil {
			resp.Authoritative = true
			resp.Answer = s.own(t, ptr, q.Name)
			return resp, false
		}
	}
	if n, wild := t.Find(name, ri.client); n != nil {
		s.answerName(t, resp, q, name, n, wild)
		return resp, false
	}
	if strings.HasPrefix(name, "_") && (q.Qtype == dns.TypeSRV || q.Qtype == dns.TypeANY) {
		if s.answerSRV(t, resp, q, name, ri.client) {
			return resp, false
		}
	}
	if s.autopath(t, resp, q, name) {
		return resp, false
	}
	if s.authoritative && dns.IsSubDomain(s.domain, name) {
		resp.Authoritative = true
		if !t.IsEmptyNonTerminal(name) {
			resp.Rcode = dns.RcodeNameError
		} else if q.Qtype == dns.TypeSOA && name == s.domain {
			resp.Answer = []dns.RR{s.soa(t, t.DomainSOA())}
			return resp, false
		}
		resp.Ns = []dns.RR{s.soa(t, t.DomainSOA())}
		return resp, false
	}
	return nil, true
}

// answerName fills resp for a name the table knows.
func (s *Server) answerName(t *nametable.Table, resp *dns.Msg, q *dns.Question, lname string, n *nametable.Name, wild bool) {
	resp.Authoritative = true
	h := n.Host
	switch q.Qtype {
	case dns.TypeA:
		resp.Answer = s.addrRRs(t, n.A, q.Name, wild)
	case dns.TypeAAAA:
		resp.Answer = s.addrRRs(t, n.AAAA, q.Name, wild)
	case dns.TypeANY:
		resp.Answer = append(s.addrRRs(t, n.A, q.Name, wild), s.addrRRs(t, n.AAAA, q.Name, wild)...)
	case dns.TypeSRV:
		if len(h.Ports) > 0 {
			target := h.Name
			if wild {
				target = lname
			}
			for i := range h.Ports {
				resp.Answer = append(resp.Answer, &dns.SRV{
					Hdr:      dns.RR_Header{Name: q.Name, Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: s.ttl},
					Priority: 0, Weight: 100, Port: h.Ports[i].Port, Target: target,
				})
			}
			resp.Extra = s.glue(t, h, target)
		}
	}
	if len(resp.Answer) == 0 {
		resp.Ns = []dns.RR{s.soa(t, h.SOA)}
	}
}

// answerSRV answers _port._proto.<name> for a known name with that port.
func (s *Server) answerSRV(t *nametable.Table, resp *dns.Msg, q *dns.Question, lname string, client netip.Addr) bool {
	// _name._proto.rest
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
	if n == nil {
		return false
	}
	h := n.Host
	for k := range h.Ports {
		p := &h.Ports[k]
		if p.Name != portName || p.Protocol != protoName {
			continue
		}
		target := h.Name
		if wild {
			target = rest
		}
		resp.Authoritative = true
		resp.Answer = []dns.RR{&dns.SRV{
			Hdr:      dns.RR_Header{Name: q.Name, Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: s.ttl},
			Priority: 0, Weight: 100, Port: p.Port, Target: target,
		}}
		resp.Extra = s.glue(t, h, target)
		return true
	}
	return false
}

// glue is the A/AAAA of an SRV target for the additional section.
func (s *Server) glue(t *nametable.Table, h *nametable.Host, target string) []dns.RR {
	out := make([]dns.RR, 0, len(h.A)+len(h.AAAA))
	out = append(out, s.own(t, h.A, target)...)
	return append(out, s.own(t, h.AAAA, target)...)
}

// autopathTarget finds the table name a search-list expansion stands for.
// It strips, in this order, a trailing <label>.svc.<domain>.,
// svc.<domain>., <domain>. or a configured search domain, and looks up what
// remains when it has at least two labels (a single label is never
// autopathed: <short>.<ns>.svc.<domain> is a real name, answered exactly or
// not at all). target is the CNAME target: the host's canonical name, or
// the remaining name for a wildcard host (never a literal "*").
func (s *Server) autopathTarget(t *nametable.Table, lname string) (n *nametable.Name, target string, wild bool) {
	try := func(rest string) bool {
		if strings.Count(rest, ".") < 2 {
			return false
		}
		n, wild = t.Find(rest, netip.Addr{})
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

// autopath answers a search-list expansion of a known name in one response:
// a CNAME to the real host followed by its records.
func (s *Server) autopath(t *nametable.Table, resp *dns.Msg, q *dns.Question, lname string) bool {
	switch q.Qtype {
	case dns.TypeA, dns.TypeAAAA, dns.TypeSRV, dns.TypeANY, dns.TypeCNAME:
	default:
		return false
	}
	n, target, wild := s.autopathTarget(t, lname)
	if n == nil {
		return false
	}
	h := n.Host
	resp.Authoritative = true
	resp.Answer = append(resp.Answer, &dns.CNAME{
		Hdr:    dns.RR_Header{Name: q.Name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
		Target: target,
	})
	switch q.Qtype {
	case dns.TypeA:
		resp.Answer = append(resp.Answer, s.addrRRs(t, h.A, target, wild)...)
	case dns.TypeAAAA:
		resp.Answer = append(resp.Answer, s.addrRRs(t, h.AAAA, target, wild)...)
	case dns.TypeANY:
		resp.Answer = append(resp.Answer, s.addrRRs(t, h.A, target, wild)...)
		resp.Answer = append(resp.Answer, s.addrRRs(t, h.AAAA, target, wild)...)
	case dns.TypeSRV:
		for i := range h.Ports {
			resp.Answer = append(resp.Answer, &dns.SRV{
				Hdr:      dns.RR_Header{Name: target, Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: s.ttl},
				Priority: 0, Weight: 100, Port: h.Ports[i].Port, Target: target,
			})
		}
		if len(h.Ports) > 0 {
			resp.Extra = s.glue(t, h, target)
		}
	}
	return true
}

// addrRRs returns A/AAAA records owned by the query name (client case),
// shuffled when there are several.
func (s *Server) addrRRs(t *nametable.Table, rrs []dns.RR, qname string, wild bool) []dns.RR {
	if len(rrs) == 0 {
		return nil
	}
	var out []dns.RR
	if wild || qname != rrs[0].Header().Name || t.TTL() != s.ttl {
		out = s.reown(rrs, qname)
	} else {
		out = make([]dns.RR, len(rrs))
		copy(out, rrs)
	}
	shuffle(out)
	return out
}

// own returns rrs as they are when owner and TTL match, else re-owned copies.
func (s *Server) own(t *nametable.Table, rrs []dns.RR, qname string) []dns.RR {
	if len(rrs) == 0 {
		return nil
	}
	if qname == rrs[0].Header().Name && t.TTL() == s.ttl {
		return rrs
	}
	return s.reown(rrs, qname)
}

func (s *Server) reown(rrs []dns.RR, owner string) []dns.RR {
	out := make([]dns.RR, len(rrs))
	for i, rr := range rrs {
		c := dns.Copy(rr)
		c.Header().Name = owner
		c.Header().Ttl = s.ttl
		out[i] = c
	}
	return out
}

func (s *Server) soa(t *nametable.Table, soa *dns.SOA) dns.RR {
	if t.TTL() == s.ttl {
		return soa
	}
	c := dns.Copy(soa).(*dns.SOA)
	c.Hdr.Ttl, c.Minttl = s.ttl, s.ttl
	return c
}

// shuffle permutes rrs in place (Fisher-Yates). math/rand/v2's top-level
// functions use a per-thread generator: no lock, no allocation.
func shuffle(rrs []dns.RR) {
	for i := len(rrs) - 1; i > 0; i-- {
		j := rand.IntN(i + 1)
		rrs[i], rrs[j] = rrs[j], rrs[i]
	}
}

// chaos answers CH TXT version.bind./version.server. and refuses the rest.
func (s *Server) chaos(resp *dns.Msg, q *dns.Question) *dns.Msg {
	name := strings.ToLower(q.Name)
	if (q.Qtype == dns.TypeTXT || q.Qtype == dns.TypeANY) && (name == "version.bind." || name == "version.server.") {
		resp.Authoritative = true
		resp.Answer = []dns.RR{&dns.TXT{
			Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeTXT, Class: dns.ClassCHAOS, Ttl: 0},
			Txt: []string{s.version},
		}}
		return resp
	}
	resp.Rcode = dns.RcodeRefused
	return resp
}

// finish adds the OPT record and truncates to what the client accepts.
func (s *Server) finish(resp *dns.Msg, ri *reqInfo) {
	if ri.opt != nil {
		// A fresh OPT each time: packing writes the extended rcode into it.
		resp.Extra = append(resp.Extra[:len(resp.Extra):len(resp.Extra)], newOPT(ri.opt.Do()))
	}
	resp.Truncate(ri.sizeLimit())
}
