package resolver

import (
	"net/netip"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// The finish step. Every stage that answers a query (or drops it) writes the outcome
// on the request (request.answered, request.drop); serve's one exit hands it to
// finish, which records it once: the metrics, the talkers, the tap. A forwarded query
// is finished by the one exit of its callback (pending.done) instead, with the
// outcome of the upstream's answer. No stage records anything itself.

// outcome is how one query was answered: what finish records.
type outcome struct {
	c     *client   // who sent it, from which port, over which transport, its egress workload
	start time.Time // when it arrived
	name  string    // the question's name (the tap; may alias the worker's buffer)
	qtype uint16
	drop  bool // not answered at all (no header, or a FORMERR response sent to us)
	rcode int  // the rcode the client got
	src   source
	kind  tap.Answer
	size  int            // the response's length
	up    netip.AddrPort // the upstream that gave the answer, if one did

	resp []byte // the response about to be sent (valid during finish only)
}

// finish records one query's outcome: the request and response counters and the
// latency (or the drop counter), the sender's talkers count and the tap. It runs
// once per query, after the response is encoded and before the transport sends it.
//
// This is also the one place where a response is known before it is released to
// the client, whichever stage answered (table, cache, upstream): the question's
// name, the response bytes (its addresses and TTLs) and the sender's cgroup (o.c.who).
// A gate on the addresses a workload may reach (DNS-gated egress) hooks in here.
func (s *Server) finish(o *outcome) {
	if o.drop {
		s.recordDrop(o.c.proto)
		return
	}
	if o.c.egress != 0 && s.grant != nil {
		s.grantAnswer(o)
	}
	s.record(o)
	s.observe(o)
}

// record counts one answered query: the request (by transport and qtype class), the
// response (by rcode class and source) and its latency. Only finish calls it, once per
// response.
func (s *Server) record(o *outcome) {
	m := s.m
	m.requests[o.c.proto][qtypeIndex(o.qtype)].Inc()
	m.responses[rcodeIndex(o.rcode)][o.src].Inc()
	m.duration[o.src].Observe(time.Since(o.start).Seconds())
}

// recordDrop counts a message deliberately not answered (finish calls it).
func (s *Server) recordDrop(p proto) {
	s.m.requests[p][nQtypes-1].Inc()
	s.m.dropped.Inc()
}

// The classes an outcome is counted in: bounded label sets, so that a client cannot
// make the metrics grow (metrics.go creates one child per class).

// qtypeLabels is the bounded qtype label set; anything else is "other".
var qtypeLabels = []string{"A", "AAAA", "PTR", "SRV", "CNAME", "MX", "TXT", "NS", "SOA", "HTTPS", "SVCB", "ANY", "other"}

const nQtypes = 13

// qtypeIndex is the class of qtype t: its index in qtypeLabels.
func qtypeIndex(t uint16) int {
	switch t {
	case dns.TypeA:
		return 0
	case dns.TypeAAAA:
		return 1
	case dns.TypePTR:
		return 2
	case dns.TypeSRV:
		return 3
	case dns.TypeCNAME:
		return 4
	case dns.TypeMX:
		return 5
	case dns.TypeTXT:
		return 6
	case dns.TypeNS:
		return 7
	case dns.TypeSOA:
		return 8
	case dns.TypeHTTPS:
		return 9
	case dns.TypeSVCB:
		return 10
	case dns.TypeANY:
		return 11
	}
	return 12
}

var rcodeLabels = []string{"NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED", "BADVERS", "other"}

const nRcodes = 8

// rcodeIndex is the class of rcode rc: its index in rcodeLabels.
func rcodeIndex(rc int) int {
	switch {
	case rc >= 0 && rc <= dns.RcodeRefused:
		return rc
	case rc == dns.RcodeBadVers:
		return 6
	}
	return 7
}

// observe tells the talkers and the tap of one answered query: who sent it
// and from which port, the question, the rcode the client got, where the
// answer came from, when the query arrived, the answer's size and the upstream
// that gave it. Without a tap subscriber it costs the talkers' count and one
// atomic load; it never allocates.
func (s *Server) observe(o *outcome) {
	c := o.c
	s.talkers.Count(c.who, o.rcode == dns.RcodeNameError, o.kind.Unanswered())
	if !s.tap.Active() {
		return
	}
	ev := tap.Event{Time: o.start.UnixNano(), Latency: int64(time.Since(o.start)), Key: c.who, Port: c.port, Upstream: o.up,
		Qtype: o.qtype, Rcode: uint16(o.rcode), Size: uint16(min(o.size, 65535)), Answer: o.kind, TCP: c.proto == protoTCP}
	ev.SetName(o.name)
	s.tap.Publish(&ev)
}

// question is the name of a message's question, or "".
func question(m *dns.Msg) string {
	if m != nil && len(m.Question) > 0 {
		return m.Question[0].Name
	}
	return ""
}
