package resolver

import (
	"net/netip"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

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

// observeReq is observe for a query answered while it is being served.
func (s *Server) observeReq(r *request, name string, qtype uint16, rcode int, a tap.Answer, size int) {
	s.observe(r.client.who, r.client.port, r.proto, name, qtype, rcode, a, r.start, size, netip.AddrPort{})
}

// question is the name of a message's question, or "".
func question(m *dns.Msg) string {
	if m != nil && len(m.Question) > 0 {
		return m.Question[0].Name
	}
	return ""
}
