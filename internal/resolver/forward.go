package resolver

import (
	"encoding/binary"
	"hash/maphash"
	"net/netip"
	"strings"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// The forward stage: cache hits are answered inline from the answer's packed records;
// misses become a pending query (a small struct: the echoed header and question, not the
// receive buffer) handed to the Forwarder with a callback, and the transport moves on.
// Pending queries are bounded in total and per client; over a bound the client gets an
// immediate SERVFAIL (total) or REFUSED (its own share), never silence.

// Default bounds of pending upstream queries.
const (
	DefaultMaxPending          = 4096
	DefaultMaxPendingPerClient = 256
	clientSlots                = 4096 // per-client counters, hashed by address
)

// pendingLimits counts pending upstream queries, in total and per client (hashed into a
// fixed array: no map, no lock, no allocation).
type pendingLimits struct {
	max, perClient int32
	total          atomic.Int32
	seed           maphash.Seed
	slots          [clientSlots]atomic.Int32
}

func (l *pendingLimits) slot(a netip.Addr) *atomic.Int32 {
	b := a.As16()
	return &l.slots[maphash.Bytes(l.seed, b[:])%clientSlots]
}

// acquire reserves a pending slot for client a; rcode is 0 on success, else the
// answer to give at once.
func (l *pendingLimits) acquire(a netip.Addr) (rcode int) {
	if l.total.Add(1) > l.max {
		l.total.Add(-1)
		return dns.RcodeServerFailure
	}
	if c := l.slot(a); c.Add(1) > l.perClient {
		c.Add(-1)
		l.total.Add(-1)
		return dns.RcodeRefused
	}
	return 0
}

func (l *pendingLimits) release(a netip.Addr) {
	l.slot(a).Add(-1)
	l.total.Add(-1)
}

// maxEcho is the most header-and-question bytes a pending query keeps.
const maxEcho = 12 + 255 + 4

// pending is one query waiting for the upstream. It holds what the response needs and
// nothing of the transport's buffers.
type pending struct {
	s      *Server
	reply  replyTo
	proto  proto
	client netip.Addr
	port   uint16
	who    workload.Key
	qname  string // the question's name (for the tap)
	start  int64  // unix nanoseconds
	qtype  uint16
	edns   bool
	do     bool
	limit  int
	cname  string // external autopath: CNAME from the question to the forwarded name
	echo   [maxEcho]byte
	nEcho  int
	msg    *dns.Msg // the unpacked request, on the unpacked path
	opt    *dns.OPT
	prefix []dns.RR // unpacked path: records before the forwarded answer

	claimed atomic.Bool // the answer is being given (claim)
}

func unixTime(ns int64) time.Time { return time.Unix(0, ns) }

// sourceOf maps the Forwarder's source to the metric label.
func sourceOf(src upstream.Source) source {
	switch src {
	case upstream.SourceCache:
		return srcCache
	case upstream.SourceStale:
		return srcStale
	}
	return srcUpstream
}

// forwardWire answers a wire-decoded query from the cache, or starts its upstream
// resolution. name is the name to forward (the question's, or the external name of an
// autopath expansion, then also cname); both may alias the worker's buffer.
func (w *worker) forwardWire(r *request, out []byte, name, cname string) []byte {
	s := w.s
	q := &w.q // a field, not a local: passing it through the interface would allocate
	*q = upstream.Query{Name: name, Qtype: r.qtype, Qclass: r.qclass, DO: r.do, CD: r.cd, ClientID: r.id()}
	if a, ok := s.fwd.Cached(q); ok {
		b := encodeWire(out, r.pkt[:r.qend], r.edns, r.do, r.limit, s.ttl, cname, &a)
		if b == nil {
			b = s.truncated(out, r.pkt[:r.qend], r.edns, r.do, r.limit, cname, &a)
		}
		kind := tap.Cache
		if cname != "" {
			kind = tap.Autopath
		}
		return r.answered(b, rcodeOf(&a, r.edns), srcCache, kind)
	}
	p := s.newPending(r)
	if p == nil {
		return w.overload(r, out)
	}
	p.nEcho = copy(p.echo[:], r.pkt[:r.qend])
	pq := *q
	if cname != "" {
		p.cname = strings.Clone(cname)
		pq.Name = p.cname
		p.qname = strings.Clone(r.lname)
	} else {
		pq.Name = strings.Clone(name)
		p.qname = pq.Name
	}
	s.fwd.ForwardAsync(&pq, p.done)
	return nil
}

// forwardMsg forwards an unpacked query (not one decodeWire takes): cache or upstream,
// the response built with miekg/dns.
func (w *worker) forwardMsg(r *request, out []byte) []byte {
	s := w.s
	q := upstream.Query{Name: r.lname, Qtype: r.qtype, Qclass: r.qclass, DO: r.do, CD: r.cd, ClientID: r.msg.Id}
	if a, ok := s.fwd.Cached(&q); ok {
		b := s.pack(s.answerMsg(r.msg, r.opt, r.limit, r.prefix, &a), out)
		kind := tap.Cache
		if r.autopath {
			kind = tap.Autopath
		}
		return r.answered(b, a.Rcode, srcCache, kind)
	}
	p := s.newPending(r)
	if p == nil {
		return w.overload(r, out)
	}
	p.msg, p.opt, p.prefix, p.qname = r.msg, r.opt, r.prefix, question(r.msg)
	if r.autopath {
		p.cname = r.lname // the tap shows it as autopath; the response is built from msg and prefix
	}
	s.fwd.ForwardAsync(&q, p.done)
	return nil
}

func (r *request) id() uint16 { return uint16(r.pkt[0])<<8 | uint16(r.pkt[1]) }

// newPending reserves a pending slot for r, or returns nil when over a bound (then
// r.overRcode says which answer to give).
func (s *Server) newPending(r *request) *pending {
	if !s.budgets.acquire(r.client.who) {
		r.overRcode, r.throttled = dns.RcodeRefused, true
		return nil
	}
	if rc := s.limits.acquire(r.client.addr); rc != 0 {
		s.budgets.release(r.client.who)
		r.overRcode = rc
		return nil
	}
	s.pending.Add(1)
	p := &pending{
		s: s, reply: r.client.reply, proto: r.proto, client: r.client.addr, port: r.client.port, who: r.client.who, start: r.start.UnixNano(),
		qtype: r.qtype, edns: r.edns, do: r.do, limit: r.limit,
	}
	r.pending, r.p = true, p
	return p
}

// overload answers a query that is over a pending bound or its workload's budget:
// SERVFAIL when the server as a whole is over, REFUSED when only this client or
// workload is.
func (w *worker) overload(r *request, out []byte) []byte {
	s := w.s
	rc, kind := r.overRcode, tap.Shed
	switch {
	case r.throttled:
		s.m.overload[2].Inc()
		kind = tap.Throttled
	case rc == dns.RcodeServerFailure:
		s.m.overload[0].Inc()
	default:
		s.m.overload[1].Inc()
	}
	var b []byte
	if r.msg != nil {
		m := new(dns.Msg)
		m.SetRcode(r.msg, rc)
		m.RecursionAvailable = true
		ri := reqInfo{proto: r.proto, opt: r.opt}
		s.limitMsg(m, &ri)
		b = s.pack(m, out)
	} else {
		b = writeHeader(out, r, false, rc, 0, 0, 0)
		if r.edns {
			b = appendOPT(b, r.do, rc)
		}
	}
	return r.answered(b, rc, srcError, kind)
}

// done is the Forwarder's callback: encode the answer and send it to the client. A
// panic while doing so is answered SERVFAIL (recoverAnswer).
func (p *pending) done(a upstream.Answer, err error) {
	if !p.claim() {
		return // serve's recovery from a panic answered it
	}
	s := p.s
	defer p.release()
	defer p.recoverAnswer()
	src := sourceOf(a.Source)
	if err != nil {
		s.log.Debug("forward failed", "err", err)
		a = upstream.Answer{Rcode: dns.RcodeServerFailure}
		src = srcError
	}
	size := p.limit
	bp := s.outBufs.get(size)
	defer s.outBufs.put(bp)
	out := (*bp)[:size]
	var b []byte
	if p.msg == nil {
		b = encodeWire(out, p.echo[:p.nEcho], p.edns, p.do, p.limit, s.ttl, p.cname, &a)
		if b == nil {
			b = s.truncated(out, p.echo[:p.nEcho], p.edns, p.do, p.limit, p.cname, &a)
		}
	} else {
		b = s.pack(s.answerMsg(p.msg, p.opt, p.limit, p.prefix, &a), out)
	}
	// The callback's one exit: finished before sending, as on the inline path, so a
	// client that has its answer sees it in the metrics.
	o := outcome{who: p.who, port: p.port, proto: p.proto, start: unixTime(p.start), name: p.qname, qtype: p.qtype,
		rcode: rcodeOf(&a, p.edns || p.opt != nil), src: src, kind: tap.Upstream, size: len(b), up: a.Server}
	switch {
	case src == srcError:
		o.kind, o.up = tap.Failed, netip.AddrPort{}
	case src == srcStale:
		o.kind = tap.Fallback
	case p.cname != "":
		o.kind = tap.Autopath
	}
	s.finish(&o)
	p.reply.send(b)
}

// rcodeOf is the rcode the client sees: an extended rcode needs EDNS.
func rcodeOf(a *upstream.Answer, edns bool) int {
	if a.Rcode > 0xF && !edns {
		return dns.RcodeServerFailure
	}
	return a.Rcode
}

// encodeWire writes the response to a wire-decoded query from a forwarded answer: the
// client's header bits and question (echo), an optional CNAME from the question to
// cname, the answer's packed records and our OPT. It returns nil when the response
// does not fit limit (the caller truncates through the unpacked path).
func encodeWire(out, echo []byte, edns, do bool, limit int, ttl uint32, cname string, a *upstream.Answer) []byte {
	size := len(echo) + len(a.Records)
	if cname != "" {
		size += 12 + len(cname) + 1
	}
	if edns {
		size += 11
	}
	if size > limit || size > len(out) {
		return nil
	}
	rc := rcodeOf(a, edns)
	recs, an, ns, ar := a.Records, a.Answer, a.Authority, a.Extra
	if rc != a.Rcode {
		recs, an, ns, ar, cname = nil, 0, 0, 0, "" // an inexpressible rcode: bare SERVFAIL
	}
	if cname != "" {
		an++
	}
	r := request{pkt: echo, qend: len(echo), edns: edns}
	b := writeHeader(out, &r, a.Authoritative && cname == "", rc, an, ns, ar)
	if a.AuthenticData && (do || echo[3]&0x20 != 0) && cname == "" {
		b[3] |= 0x20
	}
	if cname != "" {
		b = appendRRHeader(b, 0xc000|12, dns.TypeCNAME, ttl, uint16(len(cname)+1))
		b = appendName(b, cname)
	}
	recStart := len(b)
	b = append(b, recs...)
	if cname == "" {
		echoOwnerCase(b, echo[12:len(echo)-4], recStart, int(an))
	}
	if edns {
		b = appendOPT(b, do, rc)
	}
	return b
}

// echoOwnerCase gives the client's spelling back: in the n uncompressed records that
// start at b[off:], each owner name that is the question's name qname (wire form) but
// for case is overwritten with qname. Cached and upstream records carry the lower-cased
// name the upstream was asked.
func echoOwnerCase(b, qname []byte, off, n int) {
	for ; n > 0; n-- {
		end := off
		for end < len(b) && b[end] != 0 && b[end] < 64 {
			end += 1 + int(b[end])
		}
		if end >= len(b) || b[end] != 0 {
			return // compressed or malformed: leave the rest as it is
		}
		end++
		if end+10 > len(b) {
			return
		}
		if name := b[off:end]; len(name) == len(qname) && equalFoldWire(name, qname) {
			copy(name, qname)
		}
		off = end + 10 + int(binary.BigEndian.Uint16(b[end+8:]))
	}
}

// equalFoldWire compares two wire names ASCII case-insensitively (length bytes are
// below 64, so folding letters never touches them).
func equalFoldWire(a, b []byte) bool {
	for i := range a {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
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
