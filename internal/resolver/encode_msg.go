package resolver

import (
	"math/rand/v2"
	"net/netip"
	"strings"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// The dns.Msg encoder: a table decision (encodeTableMsg) or a forwarded answer
// (answerMsg) built with miekg/dns, then truncated and packed. It renders what the
// wire encoder declines, and every query decodeWire did not take.

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

// encodeTableMsg renders a decision answered from the table with miekg/dns: every
// decision the wire encoder declines (other types, SRV, PTR, pod records, alias
// chains, truncation) and every query decodeWire did not take.
func (w *worker) encodeTableMsg(r *request, d *decision, out []byte) []byte {
	s := w.s
	req, err := w.unpackReq(r)
	if err != nil {
		s.log.Warn("render answer", "err", err)
		return r.answered(servfailWire(r, out), dns.RcodeServerFailure, srcError, tap.Failed)
	}
	resp := newReply(req)
	s.renderMsg(resp, d, &req.Question[0])
	s.limitMsg(resp, &reqInfo{proto: r.proto, opt: r.opt})
	return r.answeredTable(s.pack(resp, out), d)
}

// renderMsg writes decision d into resp, the reply to question q: the CNAME chain,
// then the records of the host (owned by the chain's last target, else the question),
// the pod record or the PTR records, and the SOA.
func (s *Server) renderMsg(resp *dns.Msg, d *decision, q *dns.Question) {
	resp.Authoritative, resp.Rcode = d.aa, d.rcode
	resp.Answer = s.chainRRs(d, q.Name, false)
	owner := q.Name
	if len(d.chain) > 0 {
		owner = d.chain[len(d.chain)-1].target
	}
	var more decisionMore
	if d.more != nil {
		more = *d.more
	}
	for _, target := range more.ptr {
		resp.Answer = append(resp.Answer, &dns.PTR{
			Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypePTR, Class: dns.ClassINET, Ttl: s.ttl},
			Ptr: target,
		})
	}
	if d.addrs && d.host != nil {
		switch q.Qtype {
		case dns.TypeA:
			resp.Answer = append(resp.Answer, s.addrRRs(d.host.V4, owner, true)...)
		case dns.TypeAAAA:
			resp.Answer = append(resp.Answer, s.addrRRs(d.host.V6, owner, true)...)
		case dns.TypeANY:
			resp.Answer = append(resp.Answer, s.addrRRs(d.host.V4, owner, true)...)
			resp.Answer = append(resp.Answer, s.addrRRs(d.host.V6, owner, true)...)
		}
	}
	if more.pod.IsValid() {
		resp.Answer = append(resp.Answer, s.addrRRs([]netip.Addr{more.pod}, q.Name, false)...)
	}
	if d.srv {
		answer, extra := s.srvRRs(d.host, &more, owner)
		resp.Answer = append(resp.Answer, answer...)
		resp.Extra = extra
	}
	if d.soa != nil {
		if d.soaAnswer {
			resp.Answer = append(resp.Answer, s.soa(d.t, d.soa))
		} else {
			resp.Ns = []dns.RR{s.soa(d.t, d.soa)}
		}
	}
	if len(resp.Answer) == 0 {
		resp.Answer = nil
	}
}

// chainRRs is d's CNAME records; records owned by the question are owned by qname.
// With clone the names are copied (they may alias the worker's buffer, and the
// records of a forwarded query outlive serve).
func (s *Server) chainRRs(d *decision, qname string, clone bool) []dns.RR {
	if len(d.chain) == 0 {
		return nil
	}
	rrs := make([]dns.RR, 0, len(d.chain))
	for _, l := range d.chain {
		owner, target := l.owner, l.target
		if owner == "" {
			owner = qname
		}
		if clone {
			owner, target = strings.Clone(owner), strings.Clone(target)
		}
		rrs = append(rrs, &dns.CNAME{
			Hdr:    dns.RR_Header{Name: owner, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
			Target: target,
		})
	}
	return rrs
}

// srvRRs returns the SRV records of host h (one per port, or d's port only), owned
// by owner, and the addresses of their targets for the additional section.
func (s *Server) srvRRs(h *nametable.Host, d *decisionMore, owner string) (answer, extra []dns.RR) {
	for i := range h.Ports {
		p := &h.Ports[i]
		if d.portName != "" && (p.Name != d.portName || p.Protocol != d.portProto) {
			continue
		}
		target := d.self
		if p.Target != "" {
			target = p.Target
		}
		answer = append(answer, &dns.SRV{
			Hdr:      dns.RR_Header{Name: owner, Rrtype: dns.TypeSRV, Class: dns.ClassINET, Ttl: s.ttl},
			Priority: 0, Weight: 100, Port: p.Port, Target: target,
		})
	}
	for _, x := range d.extra {
		if x.host == nil {
			continue
		}
		extra = append(extra, s.addrRRs(x.host.V4, x.name, false)...)
		extra = append(extra, s.addrRRs(x.host.V6, x.name, false)...)
	}
	return answer, extra
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

// limitMsg adds the OPT record and truncates to what the client accepts.
func (s *Server) limitMsg(resp *dns.Msg, ri *reqInfo) {
	if ri.opt != nil {
		// A fresh OPT each time: packing writes the extended rcode into it.
		resp.Extra = append(resp.Extra[:len(resp.Extra):len(resp.Extra)], newOPT(ri.opt.Do()))
	}
	resp.Truncate(ri.sizeLimit())
}

// pack packs resp into out (a SERVFAIL header if it does not pack).
func (s *Server) pack(resp *dns.Msg, out []byte) []byte {
	b, err := resp.PackBuffer(out)
	if err != nil {
		s.log.Warn("pack response", "err", err, "name", firstName(resp))
		return headerOnly(resp.Id, resp.Opcode, dns.RcodeServerFailure, out)
	}
	if len(b) > 0 && &b[0] != &out[0] {
		// PackBuffer needed more room than out has: copy what fits (the caller sized
		// out for the transport's limit, which Truncate already applied).
		n := copy(out, b)
		return out[:n]
	}
	return b
}

func firstName(m *dns.Msg) string {
	if len(m.Question) > 0 {
		return m.Question[0].Name
	}
	return ""
}

// answerMsg builds the response to req from a forwarded answer with miekg/dns and
// truncates it to limit: for unpacked requests and for answers that need truncation.
// prefix (a CNAME chain leading to the forwarded name) goes before the answer section;
// with it the response is not authoritative.
func (s *Server) answerMsg(req *dns.Msg, opt *dns.OPT, limit int, prefix []dns.RR, a *upstream.Answer) *dns.Msg {
	out := new(dns.Msg)
	out.Id = req.Id
	out.Response = true
	out.Opcode = dns.OpcodeQuery
	out.RecursionDesired = req.RecursionDesired
	out.CheckingDisabled = req.CheckingDisabled
	out.RecursionAvailable = true
	out.Question = req.Question
	out.Rcode = rcodeOf(a, opt != nil)
	if out.Rcode == a.Rcode {
		out.Authoritative = a.Authoritative && prefix == nil
		out.AuthenticatedData = a.AuthenticData && prefix == nil && (opt != nil && opt.Do() || req.AuthenticatedData)
		an, ns, ex, err := a.RRs()
		if err != nil {
			s.log.Warn("forwarded answer", "err", err)
			out.Rcode = dns.RcodeServerFailure
		} else {
			if prefix != nil {
				an = append(prefix[:len(prefix):len(prefix)], an...)
			} else if len(req.Question) == 1 {
				qname := req.Question[0].Name
				for _, rr := range an {
					if h := rr.Header(); strings.EqualFold(h.Name, qname) {
						h.Name = qname // the client's case (DNS 0x20)
					}
				}
			}
			out.Answer, out.Ns, out.Extra = nilIfEmpty(an), nilIfEmpty(ns), nilIfEmpty(ex)
		}
	}
	if opt != nil {
		o := newOPT(opt.Do())
		out.Extra = append(out.Extra, o)
	}
	out.Truncate(limit)
	return out
}

func nilIfEmpty(rrs []dns.RR) []dns.RR {
	if len(rrs) == 0 {
		return nil
	}
	return rrs
}

// questionMsg unpacks the echoed header and question of a wire-decoded query.
func questionMsg(echo []byte) (*dns.Msg, error) {
	b := make([]byte, len(echo))
	copy(b, echo)
	clear(b[6:12]) // the OPT record is not part of the echo
	m := new(dns.Msg)
	return m, m.Unpack(b)
}

// truncated builds the response to a wire-decoded query whose answer does not fit the
// client's limit: unpacked, truncated with miekg/dns, packed.
func (s *Server) truncated(out, echo []byte, edns, do bool, limit int, cname string, a *upstream.Answer) []byte {
	m, err := questionMsg(echo)
	if err != nil {
		return headerOnly(uint16(echo[0])<<8|uint16(echo[1]), 0, dns.RcodeServerFailure, out)
	}
	var opt *dns.OPT
	if edns {
		opt = newOPT(do)
	}
	return s.pack(s.answerMsg(m, opt, limit, s.cnamePrefix(m, cname), a), out)
}

// cnamePrefix is the CNAME record of an external autopath answer (none for "").
func (s *Server) cnamePrefix(req *dns.Msg, cname string) []dns.RR {
	if cname == "" {
		return nil
	}
	return []dns.RR{&dns.CNAME{
		Hdr:    dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: s.ttl},
		Target: cname,
	}}
}
