package resolver

import (
	"hash/maphash"
	"net/netip"
	"strings"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
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
	s        *Server
	c        client // who asked and how to answer it (a copy of the transport's)
	qname    string // the question's name (for the tap)
	start    int64  // unix nanoseconds
	qtype    uint16
	edns     bool
	do       bool
	limit    int
	cname    string // wire path: the CNAME from the question to the forwarded name
	autopath bool   // a search-path expansion (the tap)
	echo     [maxEcho]byte
	nEcho    int
	msg      *dns.Msg // the unpacked request, when the dns.Msg encoder renders the answer
	opt      *dns.OPT
	prefix   []dns.RR // dns.Msg encoder: the decision's CNAME chain, before the forwarded answer

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

// forward is the forward stage of a decision to forward: the AAAA filter's NODATA, a
// cache hit, or a pending query. The wire encoder renders it when the decision has
// at most one CNAME, from the question (an external autopath expansion, an alias to
// an external name); otherwise the dns.Msg encoder does, with the chain before the
// forwarded answer.
func (w *worker) forward(r *request, d *decision, out []byte) []byte {
	wire := !w.forceMsg && r.qend > 0 && (len(d.chain) == 0 || len(d.chain) == 1 && d.chain[0].owner == "")
	if !wire {
		req, err := w.unpackReq(r)
		if err != nil {
			w.s.log.Warn("forward", "err", err)
			return r.answered(servfailWire(r, out), dns.RcodeServerFailure, srcError, tap.Failed)
		}
		r.prefix = w.s.chainRRs(d, req.Question[0].Name, true)
	}
	var cname string
	if len(d.chain) == 1 {
		cname = d.chain[0].target
	}
	if d.filtered {
		if b := w.filtered(r, d, out, wire, cname); b != nil {
			return b
		}
	}
	if wire {
		return w.forwardWire(r, out, d.fwd, cname, d.autopath)
	}
	return w.forwardMsg(r, out, d.fwd, d.autopath)
}

// filtered answers a forward decision that the AAAA filter takes: NODATA with the
// cluster domain's SOA in place of the forwarded part, built as a forwarded answer
// and encoded as one. nil: no SOA to give (forward as usual).
func (w *worker) filtered(r *request, d *decision, out []byte, wire bool, cname string) []byte {
	s := w.s
	soa := w.soaWire(d.t, d.soa)
	if soa == nil {
		return nil
	}
	a := upstream.Answer{Records: soa, Authority: 1, RecursionAvailable: true}
	var b []byte
	if wire {
		b = encodeWire(out, r.pkt[:r.qend], r.edns, r.do, r.limit, s.ttl, cname, &a)
		if b == nil {
			b = s.truncated(out, r.pkt[:r.qend], r.edns, r.do, r.limit, cname, &a)
		}
	} else {
		b = s.pack(s.answerMsg(r.msg, r.opt, r.limit, r.prefix, &a), out)
	}
	s.aaaaFiltered.Inc()
	kind := tap.Table
	if d.autopath {
		kind = tap.Autopath
	}
	return r.answered(b, dns.RcodeSuccess, srcTable, kind)
}

// forwardWire answers a wire-decoded query from the cache, or starts its upstream
// resolution. name is the name to forward (the question's, or the CNAME target cname
// the response starts with); both may alias the worker's buffer. autopath: the query
// is a search-path expansion (the tap).
func (w *worker) forwardWire(r *request, out []byte, name, cname string, autopath bool) []byte {
	s := w.s
	q := &w.q // a field, not a local: passing it through the interface would allocate
	*q = upstream.Query{Name: name, Qtype: r.qtype, Qclass: r.qclass, DO: r.do, CD: r.cd, ClientID: r.id(), Owner: r.client.who.ID()}
	if a, ok := s.fwd.Cached(q); ok {
		b := encodeWire(out, r.pkt[:r.qend], r.edns, r.do, r.limit, s.ttl, cname, &a)
		if b == nil {
			b = s.truncated(out, r.pkt[:r.qend], r.edns, r.do, r.limit, cname, &a)
		}
		kind := tap.Cache
		if autopath {
			kind = tap.Autopath
		}
		return r.answered(b, rcodeOf(&a, r.edns), srcCache, kind)
	}
	p := s.newPending(r)
	if p == nil {
		return w.overload(r, out)
	}
	p.nEcho = copy(p.echo[:], r.pkt[:r.qend])
	p.autopath = autopath
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

// forwardMsg forwards name for an unpacked query (r.msg), the response built with
// miekg/dns: r.prefix, the decision's CNAME chain, before the forwarded answer.
func (w *worker) forwardMsg(r *request, out []byte, name string, autopath bool) []byte {
	s := w.s
	q := upstream.Query{Name: strings.Clone(name), Qtype: r.qtype, Qclass: r.qclass, DO: r.do, CD: r.cd, ClientID: r.msg.Id, Owner: r.client.who.ID()}
	if a, ok := s.fwd.Cached(&q); ok {
		b := s.pack(s.answerMsg(r.msg, r.opt, r.limit, r.prefix, &a), out)
		kind := tap.Cache
		if autopath {
			kind = tap.Autopath
		}
		return r.answered(b, rcodeOf(&a, r.opt != nil), srcCache, kind)
	}
	p := s.newPending(r)
	if p == nil {
		return w.overload(r, out)
	}
	p.msg, p.opt, p.prefix, p.qname, p.autopath = r.msg, r.opt, r.prefix, strings.Clone(r.tapName()), autopath
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
		s: s, c: *r.client, start: r.start.UnixNano(),
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
	o := outcome{c: &p.c, start: unixTime(p.start), name: p.qname, qtype: p.qtype,
		rcode: rcodeOf(&a, p.edns || p.opt != nil), src: src, kind: tap.Upstream, size: len(b), up: a.Server,
		resp: b}
	switch {
	case src == srcError:
		o.kind, o.up = tap.Failed, netip.AddrPort{}
	case src == srcStale:
		o.kind = tap.Fallback
	case p.autopath:
		o.kind = tap.Autopath
	}
	s.finish(&o)
	p.c.reply.send(b)
}

// rcodeOf is the rcode the client sees: an extended rcode needs EDNS.
func rcodeOf(a *upstream.Answer, edns bool) int {
	if a.Rcode > 0xF && !edns {
		return dns.RcodeServerFailure
	}
	return a.Rcode
}
