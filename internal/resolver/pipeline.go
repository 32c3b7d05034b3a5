package resolver

import (
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/tap"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// The one query path. Every transport (the UDP readers, the TCP connections, ServeDNS)
// calls Server.serve with one received message:
//
//	decode  decode.go: the common query straight from the bytes (decodeWire); anything
//	        else unpacked with miekg/dns and screened (protocol errors, CHAOS, class,
//	        qtype: answered there)
//	decide  decide.go: the one table lookup, a decision value
//	encode  encode_wire.go renders a decision into the caller's buffer; what it
//	        declines, encode_msg.go renders with miekg/dns: the same decision
//	forward forward.go: a decision to forward goes to the cache, else upstream
//	        (asynchronous: its callback encodes and sends)
//	finish  finish.go: the outcome recorded once, at serve's one exit
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
	msg           *dns.Msg // non-nil once unpacked (decodeMsg, or unpackReq for the dns.Msg encoder)
	opt           *dns.OPT // the client's OPT, once unpacked
	overRcode     int      // set by newPending when over a bound
	throttled     bool     // ... the bound being the workload's budget
	pending       bool     // the answer comes later, through client.reply
	p             *pending // the pending query, when pending
	prefix        []dns.RR // dns.Msg encoder: the decision's CNAME chain, before the forwarded answer

	// o is the outcome (the worker's), written by the stage that answers (answered,
	// drop) and recorded by finish at serve's exit. Not part of the request's value:
	// each exit writes every field finish reads.
	o *outcome
}

// worker is the per-thread scratch space of the query path: one per UDP reader or TCP
// connection, never shared, so the path takes no lock.
type worker struct {
	s     *Server
	lname [256]byte
	perm  [maxFastAddrs]uint8
	soa   soaCache
	req   request
	o     outcome        // the outcome req.o points to
	chain [maxChain]link // the storage of the decision's CNAME chain
	q     upstream.Query
	// unpacked counts messages unpacked with miekg/dns, decided counts decisions
	// (tests check which path served a query, and that each is decided once).
	unpacked, decided uint64
	// forceMsg makes the dns.Msg encoder render every decision (the differential test
	// compares it with the wire encoder's rendering of the same decision).
	forceMsg bool
}

func newWorker(s *Server) *worker { return &worker{s: s} }

// serve answers one received message. It returns the response written into out (which
// must hold maxUDPResponse bytes for UDP, 65535 for TCP), or nil when there is nothing
// to send now: the message is dropped, or its answer comes later through c. It is the
// path's one exit: the outcome is recorded here (exit), unless the answer is pending
// (its callback records it). A panic while serving (recording included) is answered
// SERVFAIL (see panicked) and recorded as such.
func (w *worker) serve(pkt, out []byte, c *client, start time.Time) (resp []byte) {
	r := w.newRequest(pkt, c, start)
	defer func() {
		if v := recover(); v != nil {
			resp = w.panicked(v, out)
			bestEffort(func() { w.exit(resp) })
		}
	}()
	resp = w.serveQuery(r, out)
	w.exit(resp)
	return resp
}

// newRequest resets the worker's request for message pkt from c, received at start.
// (Zeroed in place, then filled: a composite literal would be built on the stack
// and copied.)
func (w *worker) newRequest(pkt []byte, c *client, start time.Time) *request {
	r := &w.req
	*r = request{}
	r.pkt, r.proto, r.client, r.start, r.o = pkt, c.proto, c, start, &w.o
	return r
}

// exit finishes the query being served: its outcome, written by the stage that
// answered it, is recorded once (and resp, the response about to be sent, offered
// to the egress grant). A pending query is finished by its callback.
func (w *worker) exit(resp []byte) {
	if r := &w.req; !r.pending {
		o := r.o
		o.c, o.start, o.name, o.qtype, o.resp = r.client, r.start, r.tapName(), r.qtype, resp
		w.s.finish(o)
		o.resp = nil
	}
}

// answered writes the outcome of a query answered while it is served: the response
// b, its rcode and where it came from. It returns b.
func (r *request) answered(b []byte, rcode int, src source, kind tap.Answer) []byte {
	o := r.o
	o.drop, o.rcode, o.src, o.kind, o.size = false, rcode, src, kind, len(b)
	return b
}

// drop writes the outcome of a message that is not answered. It returns nil.
func (r *request) drop() []byte {
	r.o.drop = true
	return nil
}

// tapName is the question's name as the tap shows it: lower case for a query
// decodeWire took (whichever encoder rendered it), else the client's spelling.
func (r *request) tapName() string {
	if r.qend == 0 && r.msg != nil {
		return question(r.msg)
	}
	return r.lname
}

// answeredTable writes the outcome of a decision answered without the upstream.
func (r *request) answeredTable(b []byte, d *decision) []byte {
	src, kind := srcTable, tap.Table
	if d.autopath {
		src, kind = srcAutopath, tap.Autopath
	}
	return r.answered(b, d.rcode, src, kind)
}

// serveQuery is serve's work on r (its message and client set): decode, decide, then
// render the decision (encode) or hand it to the forward stage. No stage after decide
// looks anything up.
func (w *worker) serveQuery(r *request, out []byte) []byte {
	if len(r.pkt) < 12 {
		return r.drop() // no header: there is no ID to answer to
	}
	if !w.decodeWire(r) {
		if b, done := w.decodeMsg(r, out); done {
			return b // a protocol error, CHAOS, another class: answered or dropped
		}
	}
	var d decision // on the stack: no write barriers, nothing kept past the query
	w.decide(r, &d)
	return w.encode(r, &d, out)
}

// encode renders decision d for r: the forward stage for a decision to forward, else
// the wire encoder, or the dns.Msg encoder for what the wire encoder declines.
func (w *worker) encode(r *request, d *decision, out []byte) []byte {
	if d.forward {
		return w.forward(r, d, out)
	}
	if !w.forceMsg {
		if b := w.encodeTableWire(r, d, out); b != nil {
			return r.answeredTable(b, d)
		}
	}
	return w.encodeTableMsg(r, d, out)
}
