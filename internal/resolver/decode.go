package resolver

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"unsafe"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// The decode step: decodeWire reads the common query straight from the bytes;
// decodeMsg unpacks anything else with miekg/dns and screens it (protocol errors,
// other opcodes and classes, CHAOS, meta types are answered here, never decided).

// decodeWire reads the common query from the bytes: QR clear, opcode QUERY, one
// question of plain labels, no answer or authority records, at most one additional
// record which is an OPT of version 0. It reports false for anything else.
func (w *worker) decodeWire(r *request) bool {
	pkt := r.pkt
	if len(pkt) < 12+5 || pkt[2]&0xfa != 0 || // QR, opcode, TC
		binary.BigEndian.Uint32(pkt[4:]) != 0x00010000 || // QD=1, AN=0
		pkt[8] != 0 || pkt[9] != 0 || pkt[10] != 0 || pkt[11] > 1 {
		return false
	}
	off, ln := 12, 0
	for {
		if off >= len(pkt) {
			return false
		}
		l := int(pkt[off])
		off++
		if l == 0 {
			break
		}
		if l > 63 || off+l > len(pkt) || ln+l+1 > 254 {
			return false
		}
		// The label and its dot, lower-cased into the name buffer; dst and src have
		// the label's length, so the loop indexes both without bounds checks.
		src, dst := pkt[off:off+l], w.lname[ln:ln+l+1]
		for i, ch := range src {
			switch {
			case ch >= 'a' && ch <= 'z', ch >= '0' && ch <= '9', ch == '-', ch == '_':
			case ch >= 'A' && ch <= 'Z':
				ch += 'a' - 'A'
			default:
				return false // needs escaping: decodeMsg
			}
			dst[i] = ch
		}
		dst[l] = '.'
		ln += l + 1
		off += l
	}
	if ln == 0 || off+4 > len(pkt) {
		return false
	}
	r.qtype = binary.BigEndian.Uint16(pkt[off:])
	r.qclass = binary.BigEndian.Uint16(pkt[off+2:])
	if r.qclass != dns.ClassINET {
		return false
	}
	switch r.qtype {
	case dns.TypeOPT, dns.TypeTSIG, dns.TypeTKEY, dns.TypeAXFR, dns.TypeIXFR:
		return false
	}
	r.qend = off + 4
	r.limit = dns.MinMsgSize
	if pkt[11] == 1 {
		o := r.qend
		if o+11 > len(pkt) || pkt[o] != 0 || binary.BigEndian.Uint16(pkt[o+1:]) != dns.TypeOPT ||
			pkt[o+5] != 0 || pkt[o+6] != 0 || // extended rcode, version
			o+11+int(binary.BigEndian.Uint16(pkt[o+9:])) != len(pkt) {
			return false
		}
		r.edns, r.do = true, pkt[o+7]&0x80 != 0
		r.limit = max(r.limit, int(binary.BigEndian.Uint16(pkt[o+3:])))
	} else if r.qend != len(pkt) {
		return false
	}
	r.cd = pkt[3]&0x10 != 0
	if r.proto == protoTCP {
		r.limit = dns.MaxMsgSize
	} else {
		r.limit = min(r.limit, maxUDPResponse)
	}
	// The name aliases w.lname: valid only during serve. Whatever outlives the call
	// (a pending upstream query) copies it.
	r.lname = unsafe.String(&w.lname[0], ln)
	return true
}

// decodeMsg is the decoder for every message decodeWire does not take: unpack with
// miekg/dns and screen it. done reports that it is answered (b) or dropped (nil)
// already; otherwise r holds the question for decide.
func (w *worker) decodeMsg(r *request, out []byte) (b []byte, done bool) {
	s := w.s
	w.unpacked++
	r.qend, r.edns, r.do = 0, false, false // what decodeWire read before it gave up
	msg := new(dns.Msg)
	if err := msg.Unpack(r.pkt); err != nil {
		if b = formErr(r.pkt, out); b == nil {
			return r.drop(), true
		}
		return r.answered(b, dns.RcodeFormatError, srcError, tap.Error), true
	}
	r.msg = msg
	if len(msg.Question) > 0 {
		r.qtype = msg.Question[0].Qtype
	}
	ri := reqInfo{proto: r.proto, client: r.client.addr}
	resp := newReply(msg)
	reply, done := s.screen(msg, resp, &ri)
	r.opt, r.limit = ri.opt, ri.sizeLimit()
	if done {
		if reply == nil {
			return r.drop(), true
		}
		s.limitMsg(reply, &ri)
		b = s.pack(reply, out)
		src, kind := srcTable, tap.Table // CHAOS version.bind
		switch reply.Rcode {
		case dns.RcodeFormatError, dns.RcodeNotImplemented, dns.RcodeRefused, dns.RcodeBadVers:
			src, kind = srcError, tap.Error
		}
		return r.answered(b, reply.Rcode, src, kind), true
	}
	q := msg.Question[0]
	r.qclass, r.cd = q.Qclass, msg.CheckingDisabled
	r.edns = ri.opt != nil
	r.do = r.edns && ri.opt.Do()
	r.lname = lowerName(q.Name)
	return nil, false
}

// unpackReq returns r's unpacked message: a message decodeWire took is unpacked now,
// for the dns.Msg encoder (decodeWire accepted it, so it unpacks and passes screen).
func (w *worker) unpackReq(r *request) (*dns.Msg, error) {
	if r.msg != nil {
		return r.msg, nil
	}
	w.unpacked++
	msg := new(dns.Msg)
	if err := msg.Unpack(r.pkt); err != nil {
		return nil, fmt.Errorf("unpack a decoded query: %w", err)
	}
	if len(msg.Question) != 1 {
		return nil, errors.New("unpack a decoded query: not one question")
	}
	r.msg, r.opt = msg, msg.IsEdns0()
	return msg, nil
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

// formErr answers a packet that does not unpack: FORMERR echoing ID and opcode. A
// FORMERR response sent to us is not answered (nil): two servers would otherwise
// bounce FORMERRs forever.
func formErr(pkt, out []byte) []byte {
	if pkt[2]&0x80 != 0 && pkt[3]&0xf == dns.RcodeFormatError {
		return nil
	}
	b := headerOnly(binary.BigEndian.Uint16(pkt), int(pkt[2]>>3&0xf), dns.RcodeFormatError, out)
	b[2] |= pkt[2] & 0x01 // RD
	return b
}

func lowerName(n string) string {
	for i := 0; i < len(n); i++ {
		if 'A' <= n[i] && n[i] <= 'Z' {
			b := []byte(n)
			for j := i; j < len(b); j++ {
				if 'A' <= b[j] && b[j] <= 'Z' {
					b[j] += 'a' - 'A'
				}
			}
			return string(b)
		}
	}
	return n
}
