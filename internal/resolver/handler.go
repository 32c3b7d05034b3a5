package resolver

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
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
	// chase, when set, is a CNAME target outside the table to forward in
	// place of the question; prefix are the records that lead to it.
	chase  string
	prefix []dns.RR
	// autopath is set when a search-path expansion was answered (metrics, the tap).
	autopath bool
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
	resp = newReply(req)
	if reply, done := s.screen(req, resp, ri); done {
		return reply, false
	}
	t := s.tables.Table()
	if t == nil {
		return nil, true // not loaded yet: forward rather than fail
	}
	return s.answerTable(t, resp, &req.Question[0], ri)
}

// newReply is the response header for req.
func newReply(req *dns.Msg) *dns.Msg {
	resp := new(dns.Msg)
	resp.Id = req.Id
	resp.Response = true
	resp.Opcode = req.Opcode
	resp.RecursionAvailable = true
	resp.RecursionDesired = req.RecursionDesired
	resp.CheckingDisabled = req.CheckingDisabled
	if len(req.Question) == 1 {
		resp.Question = req.Question
	}
	return resp
}

// screen answers what is not a plain IN query at once: responses, other
// opcodes, malformed EDNS or questions, other classes (CHAOS is answered)
// and meta or zone-transfer types. done reports that reply (nil: nothing
// is sent back) is the answer; ri.opt is set either way.
func (s *Server) screen(req, resp *dns.Msg, ri *reqInfo) (reply *dns.Msg, done bool) {
	if req.Response {
		if req.Rcode == dns.RcodeFormatError {
			return nil, true
		}
		resp.Rcode = dns.RcodeFormatError
		return resp, true
	}
	if req.Opcode != dns.OpcodeQuery {
		resp.Rcode = dns.RcodeNotImplemented
		return resp, true
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
		return resp, true
	}
	if ri.opt != nil && ri.opt.Version() != 0 {
		resp.Rcode = dns.RcodeBadVers
		return resp, true
	}
	q := &req.Question[0]
	switch {
	case q.Qclass == dns.ClassCHAOS:
		return s.chaos(resp, q), true
	case q.Qclass != dns.ClassINET:
		resp.Rcode = dns.RcodeRefused
		return resp, true
	}
	switch q.Qtype {
	case dns.TypeOPT, dns.TypeTSIG, dns.TypeTKEY:
		resp.Rcode = dns.RcodeFormatError
		return resp, true
	case dns.TypeAXFR, dns.TypeIXFR:
		resp.Rcode = dns.RcodeRefused
		return resp, true
	}
	return nil, false
}

// answerTable answers q from the table t: a known name, a pod record, an SRV
// name, an autopath search, or, under an authoritative domain, NXDOMAIN or
// NODATA. forward (with resp nil) sends it upstream instead.
func (s *Server) answerTable(t *nametable.Table, resp *dns.Msg, q *dns.Question, ri *reqInfo) (_ *dns.Msg, forward bool) {
	name := strings.ToLower(q.Name)
	if q.Qtype == dns.TypePTR {
		if targets := t.PTR(name); targets != nil {
			resp.Authoritative = true
			for _, target := range targets {
				resp.Answer = append(resp.Answer, &dns.PTR{
					Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypePTR, Class: dns.ClassINET, Ttl: s.ttl},
					Ptr: target,
				})
			}
			return resp, false
		}
	}
	if n, wild := t.Find(name, ri.client); n != nil {
		if s.answerName(t, resp, q, name, n, wild, ri) {
			return nil, true // a CNAME to a name outside the table: chased upstream
		}
		return resp, false
	}
	if s.podRecords && strings.HasSuffix(name, s.dotPod) {
		if s.answerPod(t, resp, q, name) {
			return resp, false
		}
	}
	if strings.HasPrefix(name, "_") && (q.Qtype == dns.TypeSRV || q.Qtype == dns.TypeANY) {
		if s.answerSRV(t, resp, q, name, ri.client) {
			return resp, false
		}
	}
	if ok, chase := s.autopath(t, resp, q, name, ri); ok {
		if chase {
			return nil, true
		}
		return resp, false
	}
	if s.externalAutopathMsg(t, q, name, ri) {
		return nil, true
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

// answerName fills resp for a name the table knows. For an alias host
// (CNAME) whose target the table does not answer, it returns chase ==
// true with ri set up to forward the target (see forward).
func (s *Server) answerName(t *nametable.Table, resp *dns.Msg, q *dns.Question, lname string, n *nametable.Name, wild bool, ri *reqInfo) (chase bool) {
	resp.Authoritative = true
	h := n.Host
	if h.CNAME() != "" {
		return s.answerAlias(t, resp, q, q.Name, h, ri)
	}
	switch q.Qtype {
	case dns.TypeA:
		resp.Answer = s.addrRRs(h.V4, q.Name, true)
	case dns.TypeAAAA:
		resp.Answer = s.addrRRs(h.V6, q.Name, true)
	case dns.TypeANY:
		resp.Answer = append(s.addrRRs(h.V4, q.Name, true), s.addrRRs(h.V6, q.Name, true)...)
	case dns.TypeSRV:
		self := h.Name
		if wild {
			self = lname
		}
		resp.Answer, resp.Extra = s.srvRRs(t, h, q.Name, self, "", "", ri.client)
	}
	if len(resp.Answer) == 0 {
		resp.Ns = []dns.RR{s.soa(t, t.SOA(h))}
	}
	return false
}

// answerAlias answers owner (a name of alias host h) with a CNAME to
// h.CNAME, followed by the target's records when the table has them. A
// target the table does not know is chased upstream: ri.chase is set and
// true is returned.
func (s *Server) answerAlias(t *nametable.Table, resp *dns.Msg, q *dns.Question, owner string, h *nametable.Host, ri *reqInfo) bool {
	cname := &dns.CNAME{
		Hdr:    dns.RR_Header{Name: owner, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
		Target: h.CNAME(),
	}
	resp.Answer = append(resp.Answer, cname)
	if q.Qtype == dns.TypeCNAME {
		return false
	}
	target := h.CNAME()
	for range 8 { // follow aliases inside the table, bounded
		tn, _ := t.Find(target, ri.client)
		if tn == nil {
			break
		}
		if tn.Host.CNAME() != "" {
			resp.Answer = append(resp.Answer, &dns.CNAME{
				Hdr:    dns.RR_Header{Name: target, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
				Target: tn.Host.CNAME(),
			})
			target = tn.Host.CNAME()
			continue
		}
		switch q.Qtype {
		case dns.TypeA:
			resp.Answer = append(resp.Answer, s.addrRRs(tn.Host.V4, target, true)...)
		case dns.TypeAAAA:
			resp.Answer = append(resp.Answer, s.addrRRs(tn.Host.V6, target, true)...)
		case dns.TypeANY:
			resp.Answer = append(resp.Answer, s.addrRRs(tn.Host.V4, target, true)...)
			resp.Answer = append(resp.Answer, s.addrRRs(tn.Host.V6, target, true)...)
		}
		return false
	}
	if dns.IsSubDomain(s.domain, target) && s.authoritative {
		// Under our own domain and not in the table: it does not exist.
		resp.Rcode = dns.RcodeNameError
		resp.Ns = []dns.RR{s.soa(t, t.DomainSOA())}
		return false
	}
	ri.chase = target
	ri.prefix = resp.Answer
	return true
}

// srvRRs returns the SRV records of host h (named self in the answer) for
// the port name and protocol (both "" for every port), owned by owner, and
// the addresses of their targets for the additional section.
func (s *Server) srvRRs(t *nametable.Table, h *nametable.Host, owner, self, portName, proto string, client netip.Addr) (answer, extra []dns.RR) {
	var targets []string
	for i := range h.Ports {
		p := &h.Ports[i]
		if portName != "" && (p.Name != portName || p.Protocol != proto) {
			continue
		}
		target := self
		if p.Target != "" {
			target = p.Target
		}
		answer = append(answer, &dns.SRV{
			Hdr:      dns.RR_Header{Name: owner, Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: s.ttl},
			Priority: 0, Weight: 100, Port: p.Port, Target: target,
		})
		if !slices.Contains(targets, target) {
			targets = append(targets, target)
		}
	}
	for _, target := range targets {
		th := h
		if target != self {
			tn, _ := t.Find(target, client)
			if tn == nil {
				continue
			}
			th = tn.Host
		}
		extra = append(extra, s.addrRRs(th.V4, target, false)...)
		extra = append(extra, s.addrRRs(th.V6, target, false)...)
	}
	return answer, extra
}

// answerPod answers <a-b-c-d>.<ns>.pod.<domain> (and the dashed IPv6 form)
// with the address in the name, as CoreDNS's "pods insecure" does.
func (s *Server) answerPod(t *nametable.Table, resp *dns.Msg, q *dns.Question, lname string) bool {
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
	resp.Authoritative = true
	ip = ip.Unmap()
	switch {
	case ip.Is4() && (q.Qtype == dns.TypeA || q.Qtype == dns.TypeANY):
		resp.Answer = s.addrRRs([]netip.Addr{ip}, q.Name, false)
	case ip.Is6() && (q.Qtype == dns.TypeAAAA || q.Qtype == dns.TypeANY):
		resp.Answer = s.addrRRs([]netip.Addr{ip}, q.Name, false)
	}
	if len(resp.Answer) == 0 {
		resp.Ns = []dns.RR{s.soa(t, t.DomainSOA())}
	}
	return true
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
	self := n.Host.Name
	if wild {
		self = rest
	}
	answer, extra := s.srvRRs(t, n.Host, q.Name, self, portName, protoName, client)
	if len(answer) == 0 {
		return false
	}
	resp.Authoritative = true
	resp.Answer, resp.Extra = answer, extra
	return true
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

// autopath answers a search-list expansion of a known name in one response:
// a CNAME to the real host followed by its records.
func (s *Server) autopath(t *nametable.Table, resp *dns.Msg, q *dns.Question, lname string, ri *reqInfo) (answered, chase bool) {
	switch q.Qtype {
	case dns.TypeA, dns.TypeAAAA, dns.TypeSRV, dns.TypeANY, dns.TypeCNAME:
	default:
		return false, false
	}
	n, target, _ := s.autopathTarget(t, lname, ri.client)
	if n == nil {
		return false, false
	}
	h := n.Host
	ri.autopath = true
	resp.Authoritative = true
	resp.Answer = append(resp.Answer, &dns.CNAME{
		Hdr:    dns.RR_Header{Name: q.Name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
		Target: target,
	})
	if h.CNAME() != "" {
		// The search-path name stands for an alias: answer the rest as for
		// the alias itself.
		return true, s.answerAlias(t, resp, q, target, h, ri)
	}
	switch q.Qtype {
	case dns.TypeA:
		resp.Answer = append(resp.Answer, s.addrRRs(h.V4, target, true)...)
	case dns.TypeAAAA:
		resp.Answer = append(resp.Answer, s.addrRRs(h.V6, target, true)...)
	case dns.TypeANY:
		resp.Answer = append(resp.Answer, s.addrRRs(h.V4, target, true)...)
		resp.Answer = append(resp.Answer, s.addrRRs(h.V6, target, true)...)
	case dns.TypeSRV:
		answer, extra := s.srvRRs(t, h, target, target, "", "", ri.client)
		resp.Answer = append(resp.Answer, answer...)
		resp.Extra = extra
	}
	return true, false
}

// externalAutopathMsg is external-name autopath on the unpacked path, for every
// query type: as on the wire path (tableWire), a known client's first search-suffix
// expansion of an external name that no table autopath answers is forwarded as the
// external name, behind a CNAME from the question to it (ri.chase and ri.prefix).
func (s *Server) externalAutopathMsg(t *nametable.Table, q *dns.Question, lname string, ri *reqInfo) bool {
	ext, ok := s.externalAutopath(t, lname, ri.client)
	if !ok {
		return false
	}
	if n, _, _ := s.autopathTarget(t, lname, ri.client); n != nil {
		return false // a table name by another search suffix (a type autopath does not answer)
	}
	ri.chase, ri.autopath = ext, true
	ri.prefix = []dns.RR{&dns.CNAME{
		Hdr:    dns.RR_Header{Name: q.Name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
		Target: ext,
	}}
	return true
}

// addrRRs returns A/AAAA records of addrs owned by owner, shuffled when
// asked and there are several.
func (s *Server) addrRRs(addrs []netip.Addr, owner string, shuffleThem bool) []dns.RR {
	if len(addrs) == 0 {
		return nil
	}
	out := make([]dns.RR, len(addrs))
	for i, a := range addrs {
		hdr := dns.RR_Header{Name: owner, Class: dns.ClassINET, Ttl: s.ttl}
		if a.Is4() {
			hdr.Rrtype = dns.TypeA
			b := a.As4()
			out[i] = &dns.A{Hdr: hdr, A: b[:]}
		} else {
			hdr.Rrtype = dns.TypeAAAA
			b := a.As16()
			out[i] = &dns.AAAA{Hdr: hdr, AAAA: b[:]}
		}
	}
	if shuffleThem {
		shuffle(out)
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

// limitMsg adds the OPT record and truncates to what the client accepts.
func (s *Server) limitMsg(resp *dns.Msg, ri *reqInfo) {
	if ri.opt != nil {
		// A fresh OPT each time: packing writes the extended rcode into it.
		resp.Extra = append(resp.Extra[:len(resp.Extra):len(resp.Extra)], newOPT(ri.opt.Do()))
	}
	resp.Truncate(ri.sizeLimit())
}
