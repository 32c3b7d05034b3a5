package resolver

import (
	"net/netip"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// The finish step. Every stage that answers a query (or drops it) writes the outcome
// on the request (request.answered, request.drop); serve's one exit hands it to
// finish, which records it once: the metrics, the talkers, the tap. A forwarded query
// is finished by the one exit of its callback (pending.done) instead, with the
// outcome of the upstream's answer. No stage records anything itself.

// outcome is how one query was answered: what finish records.
type outcome struct {
	who   workload.Key // who sent it
	port  uint16
	proto proto
	start time.Time // when it arrived
	name  string    // the question's name (the tap; may alias the worker's buffer)
	qtype uint16
	drop  bool // not answered at all (no header, or a FORMERR response sent to us)
	rcode int  // the rcode the client got
	src   source
	kind  tap.Answer
	size  int            // the response's length
	up    netip.AddrPort // the upstream that gave the answer, if one did

	egress uint32 // the sender's egress workload (0: none)
	resp   []byte // the response about to be sent (valid during finish only)
}

// finish records one query's outcome: the request and response counters and the
// latency (or the drop counter), the sender's talkers count and the tap. It runs
// once per query, after the response is encoded and before the transport sends it.
//
// This is also the one place where a response is known before it is released to
// the client, whichever stage answered (table, cache, upstream): the question's
// name, the response bytes (its addresses and TTLs) and the sender's cgroup (o.who).
// A gate on the addresses a workload may reach (DNS-gated egress) hooks in here.
func (s *Server) finish(o *outcome) {
	if o.drop {
		s.recordDrop(o.proto)
		return
	}
	if o.egress != 0 && s.grant != nil {
		s.grantAnswer(o)
	}
	s.record(o.proto, o.qtype, o.rcode, o.src, o.start)
	s.observe(o.who, o.port, o.proto, o.name, o.qtype, o.rcode, o.kind, o.start, o.size, o.up)
}

// record counts one answered query: the request, the response and its latency. Only
// finish calls it, once per response.
func (s *Server) record(p proto, qtype uint16, rcode int, src source, start time.Time) {
	m := s.m
	m.requests[p][qtypeIndex(qtype)].Inc()
	m.responses[rcodeIndex(rcode)][src].Inc()
	m.duration[src].Observe(time.Since(start).Seconds())
}

// recordDrop counts a message deliberately not answered (finish calls it).
func (s *Server) recordDrop(p proto) {
	s.m.requests[p][nQtypes-1].Inc()
	s.m.dropped.Inc()
}

// observe tells the talkers and the tap of one answered query: who sent it
// and from which port, the question, the rcode the client got, where the
// answer came from, when the query arrived, the answer's size and the upstream
// that gave it. Without a tap subscriber it costs the talkers' count and one
// atomic load; it never allocates.
func (s *Server) observe(who workload.Key, port uint16, p proto, name string, qtype uint16, rcode int, a tap.Answer, start time.Time, size int, up netip.AddrPort) {
	s.talkers.Count(who, rcode == dns.RcodeNameError, a.Unanswered())
	if !s.tap.Active() {
		return
	}
	ev := tap.Event{Time: start.UnixNano(), Latency: int64(time.Since(start)), Key: who, Port: port, Upstream: up,
		Qtype: qtype, Rcode: uint16(rcode), Size: uint16(min(size, 65535)), Answer: a, TCP: p == protoTCP}
	ev.SetName(name)
	s.tap.Publish(&ev)
}

// question is the name of a message's question, or "".
func question(m *dns.Msg) string {
	if m != nil && len(m.Question) > 0 {
		return m.Question[0].Name
	}
	return ""
}
