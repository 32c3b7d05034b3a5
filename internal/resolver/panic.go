package resolver

import (
	"encoding/binary"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// A panic on the query path never takes the agent down: serve (every transport's
// entry) and pending.done (a forwarded answer's encoder) recover it, answer the
// query SERVFAIL and count it (Config.Panics). A pending query is answered exactly
// once: by its callback or by serve's recovery, whichever claims it.

// panicked answers the query whose serving panicked with v, in out: SERVFAIL, unless
// the forwarder's callback claimed its answer already (then nil: the callback answers).
func (w *worker) panicked(v any, out []byte) []byte {
	s := w.s
	r := &w.req
	s.panics.Recovered(panicguard.StageServe, v, "client", r.client.addr, "qtype", r.qtype, "qname", r.lname)
	if r.p != nil {
		if !r.p.claim() {
			return nil
		}
		r.p.release()
	}
	r.pending, r.p = false, nil
	return r.answered(servfailWire(r, out), dns.RcodeServerFailure, srcError, tap.Failed)
}

// servfailWire writes SERVFAIL for r into out without miekg/dns: the client's header
// bits and question (and an OPT when it sent one) when they were read, else the header
// alone. It only copies bytes, so it cannot fail where the query path did.
func servfailWire(r *request, out []byte) []byte {
	pkt := r.pkt
	if r.qend > 0 && r.qend <= len(pkt) {
		b := writeHeader(out, r, false, dns.RcodeServerFailure, 0, 0, 0)
		if r.edns {
			b = appendOPT(b, r.do, dns.RcodeServerFailure)
		}
		return b
	}
	if r.msg != nil && len(r.msg.Question) == 1 {
		m := new(dns.Msg)
		m.SetRcode(r.msg, dns.RcodeServerFailure)
		m.RecursionAvailable = true
		if o := r.msg.IsEdns0(); o != nil {
			m.SetEdns0(ourUDPSize, o.Do())
		}
		if b, err := m.PackBuffer(out); err == nil && len(b) > 0 && &b[0] == &out[0] {
			return b
		}
	}
	b := headerOnly(binary.BigEndian.Uint16(pkt), int(pkt[2]>>3&0xf), dns.RcodeServerFailure, out)
	b[2] |= pkt[2] & 0x01 // RD
	return b
}

// claim takes the right to answer p: true for exactly one caller.
func (p *pending) claim() bool { return p.claimed.CompareAndSwap(false, true) }

// release frees p's share of the pending bounds and of its workload's budget.
func (p *pending) release() {
	p.s.budgets.release(p.c.who)
	p.s.limits.release(p.c.addr)
	p.s.pending.Done()
}

// recoverAnswer, deferred by done, answers SERVFAIL when encoding or sending the
// forwarded answer panicked.
func (p *pending) recoverAnswer() {
	v := recover()
	if v == nil {
		return
	}
	p.s.panics.Recovered(panicguard.StageAnswer, v, "client", p.c.addr, "qtype", p.qtype, "qname", p.qname)
	out := make([]byte, maxEcho+64)
	var b []byte
	if p.msg != nil {
		b = servfailWire(&request{pkt: p.echo[:p.nEcho], msg: p.msg}, out)
	} else {
		b = servfailWire(&request{pkt: p.echo[:p.nEcho], qend: p.nEcho, edns: p.edns, do: p.do}, out)
	}
	bestEffort(func() { p.c.reply.send(b) })
}

// bestEffort runs fn, which reports or sends for a query that already failed; a second
// panic there is dropped, not raised from a deferred recovery.
func bestEffort(fn func()) {
	defer func() { _ = recover() }()
	fn()
}
