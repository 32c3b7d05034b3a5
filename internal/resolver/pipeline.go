package resolver

import (
	"encoding/binary"
	"time"
	"unsafe"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// The one query path. Every transport (the UDP readers, the TCP connections, ServeDNS)
// calls Server.serve with one received message:
//
//	decode   (decodeWire: the common query straight from the bytes; else miekg/dns unpack)
//	classify (protocol errors, CHAOS, class, qtype: answered here)
//	answer   table (table.go) -> cache -> upstream (forward.go, asynchronous)
//	encode   into the caller's buffer, the same bytes for UDP and TCP but the size limit
//
// Table and cache answers are written inline, from pre-packed records, without
// unpacking, allocating, locking or starting a goroutine. A query that needs the
// upstream is handed to the Forwarder with a callback that encodes and sends the
// answer later; the transport is free at once. Each stage writes the outcome on the
// request; serve's one exit (and the callback's, for a forwarded answer) records it
// once (finish.go).

// maxUDPResponse caps UDP responses whatever size a client advertises.
const maxUDPResponse = 4096

// request is a decoded query. For the common query the fields are read from the wire
// and name aliases the decoder's buffer (valid only while serve runs); for anything
// else msg holds the unpacked message.
type request struct {
	pkt    []byte // the query as received
	proto  proto
	client *client
	start  time.Time

	qend          int    // end of the question in pkt: header and question are echoed from here
	lname         string // lower-cased question name (aliases the worker's buffer on the wire path)
	qtype, qclass uint16
	edns, do      bool
	cd            bool
	limit         int      // the largest response the client takes
	msg           *dns.Msg // non-nil on the unpacked path
	opt           *dns.OPT // the client's OPT on the unpacked path
	overRcode     int      // set by newPending when over a bound
	throttled     bool     // ... the bound being the workload's budget
	pending       bool     // the answer comes later, through client.reply
	p             *pending // the pending query, when pending
	prefix        []dns.RR // unpacked path: records before the forwarded answer (an alias chase)
	autopath      bool     // unpacked path: the forwarded name is a search-path expansion's (the tap)

	// The outcome, written by the stage that answers (answered, drop) and recorded
	// by finish at serve's exit.
	dropped bool
	rcode   int
	src     source
	kind    tap.Answer
	size    int
}

// worker is the per-thread scratch space of the query path: one per UDP reader or TCP
// connection, never shared, so the path takes no lock.
type worker struct {
	s     *Server
	lname [256]byte
	perm  [maxFastAddrs]uint8
	soa   soaCache
	req   request
	o     outcome // serve's exit: what finish records
	q     upstream.Query
	// unpacked counts messages that took the unpacked path (tests check which path
	// served a query).
	unpacked uint64
}

func newWorker(s *Server) *worker { return &worker{s: s} }

// serve answers one received message. It returns the response written into out (which
// must hold maxUDPResponse bytes for UDP, 65535 for TCP), or nil when there is nothing
// to send now: the message is dropped, or its answer comes later through c. It is the
// path's one exit: the outcome is recorded here (finish), unless the answer is
// pending (its callback records it).
func (w *worker) serve(pkt, out []byte, c *client, start time.Time) []byte {
	b := w.serveGuarded(pkt, out, c, start)
	if o := w.req.outcome(&w.o); o != nil {
		w.s.finish(o)
	}
	return b
}

// serveGuarded is serveQuery; a panic while serving is answered SERVFAIL (see
// panicked).
func (w *worker) serveGuarded(pkt, out []byte, c *client, start time.Time) (resp []byte) {
	defer func() {
		if v := recover(); v != nil {
			resp = w.panicked(v, out)
		}
	}()
	return w.serveQuery(pkt, out, c, start)
}

// serveQuery is serve's work: decode, answer from the table or the cache, or forward.
func (w *worker) serveQuery(pkt, out []byte, c *client, start time.Time) []byte {
	r := &w.req
	*r = request{pkt: pkt, proto: c.proto, client: c, start: start}
	if len(pkt) < 12 {
		return r.drop() // no header: there is no ID to answer to
	}
	if !w.decodeWire(r) {
		return w.serveUnpacked(r, out)
	}
	if b, done := w.tableWire(r, out); done {
		return b
	}
	if b, done := w.filterAAAA(r, out, ""); done {
		return b
	}
	return w.forwardWire(r, out, r.lname, "")
}

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
		for _, ch := range pkt[off : off+l] {
			switch {
			case ch >= 'a' && ch <= 'z', ch >= '0' && ch <= '9', ch == '-', ch == '_':
			case ch >= 'A' && ch <= 'Z':
				ch += 'a' - 'A'
			default:
				return false // needs escaping: the unpacked path
			}
			w.lname[ln] = ch
			ln++
		}
		w.lname[ln] = '.'
		ln++
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

// writeHeader starts a wire response: the client's ID, opcode, question and RD/CD bits,
// QR and RA set, the given AA bit and rcode, and the section counts.
func writeHeader(out []byte, r *request, aa bool, rcode int, an, ns, ar uint16) []byte {
	b := out[:r.qend]
	copy(b, r.pkt[:r.qend])
	b[2] = 0x80 | r.pkt[2]&0x01 // QR, RD
	if aa {
		b[2] |= 0x04
	}
	b[3] = 0x80 | r.pkt[3]&0x10 | byte(rcode&0xf) // RA, CD
	if r.edns {
		ar++
	}
	binary.BigEndian.PutUint16(b[6:], an)
	binary.BigEndian.PutUint16(b[8:], ns)
	binary.BigEndian.PutUint16(b[10:], ar)
	return b
}

// appendOPT appends our OPT record (UDP size ourUDPSize, the client's DO, the upper
// bits of an extended rcode).
func appendOPT(b []byte, do bool, rcode int) []byte {
	var flags byte
	if do {
		flags = 0x80
	}
	return append(b, 0, 0, byte(dns.TypeOPT), byte(ourUDPSize>>8), byte(ourUDPSize&0xff), byte(rcode>>4), 0, flags, 0, 0, 0)
}

func appendRRHeader(b []byte, owner, rrtype uint16, ttl uint32, rdlen uint16) []byte {
	return append(b, byte(owner>>8), byte(owner), byte(rrtype>>8), byte(rrtype),
		0, byte(dns.ClassINET), byte(ttl>>24), byte(ttl>>16), byte(ttl>>8), byte(ttl),
		byte(rdlen>>8), byte(rdlen))
}

// appendName writes a lower-case FQDN ("a.b.") as uncompressed wire labels. Names
// here are table names or names that decodeWire accepted: plain labels, no escapes.
func appendName(b []byte, name string) []byte {
	start := 0
	for i := 0; i < len(name); i++ {
		if name[i] == '.' {
			b = append(b, byte(i-start))
			b = append(b, name[start:i]...)
			start = i + 1
		}
	}
	return append(b, 0)
}

// headerOnly builds a 12-byte response with the given rcode.
func headerOnly(id uint16, opcode, rcode int, out []byte) []byte {
	b := out[:12]
	clear(b)
	binary.BigEndian.PutUint16(b[0:], id)
	b[2] = 0x80 | byte(opcode&0xf)<<3
	b[3] = 0x80 | byte(rcode&0xf) // RA
	return b
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

// serveUnpacked is the path for every message decodeWire does not take: unpack with
// miekg/dns, classify, answer from the table or forward.
func (w *worker) serveUnpacked(r *request, out []byte) []byte {
	s := w.s
	w.unpacked++
	msg := new(dns.Msg)
	if err := msg.Unpack(r.pkt); err != nil {
		b := formErr(r.pkt, out)
		if b == nil {
			return r.drop()
		}
		return r.answered(b, dns.RcodeFormatError, srcError, tap.Error)
	}
	r.msg = msg
	ri := reqInfo{proto: r.proto, client: r.client.addr}
	resp, fwd := s.local(msg, &ri)
	r.opt = ri.opt
	r.limit = ri.sizeLimit()
	if len(msg.Question) > 0 {
		r.qtype = msg.Question[0].Qtype
	}
	switch {
	case fwd:
		q := msg.Question[0]
		r.qtype, r.qclass, r.cd = q.Qtype, q.Qclass, msg.CheckingDisabled
		r.edns = ri.opt != nil
		r.do = r.edns && ri.opt.Do()
		r.lname = lowerName(q.Name)
		if ri.chase != "" {
			// An alias whose target the table does not answer: forward the target
			// behind the records that lead to it.
			r.lname, r.prefix, r.autopath = lowerName(ri.chase), ri.prefix, ri.autopath
		}
		if b, done := w.filterAAAA(r, out, ""); done {
			return b
		}
		return w.forwardMsg(r, out)
	case resp == nil:
		return r.drop()
	}
	src := srcTable
	if ri.autopath {
		src = srcAutopath
	}
	switch resp.Rcode {
	case dns.RcodeFormatError, dns.RcodeNotImplemented, dns.RcodeRefused, dns.RcodeBadVers:
		src = srcError
	}
	s.limitMsg(resp, &ri)
	b := s.pack(resp, out)
	kind := tap.Table
	switch {
	case src == srcError:
		kind = tap.Error
	case ri.autopath:
		kind = tap.Autopath
	}
	return r.answered(b, resp.Rcode, src, kind)
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
