package resolver

import (
	"net/netip"
	"sync"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Who sent a query and where its answer goes: the client of each query (its
// address, the workload the datapath attributed it to) and the reply path
// (UDP, a TCP connection, an in-process caller).

// client is where a query came from and how to answer it later.
type client struct {
	proto  proto
	addr   netip.Addr // unmapped
	port   uint16
	who    workload.Key // who sent it
	egress uint32       // its egress workload (Sender.Egress; 0: none)
	reply  replyTo
}

// Sender is who sent from a source address and port, as the datapath recorded
// it: the cgroup and process (0: not attributed) and the egress workload whose
// policy governs it (0: none).
type Sender struct {
	Cgroup uint64
	PID    uint32
	Egress uint32
}

// setSender records the client's address and who sent from it.
func (c *client) setSender(s *Server, src netip.AddrPort) {
	c.addr, c.port = src.Addr().Unmap(), src.Port()
	c.who = workload.Key{Addr: c.addr}
	c.egress = 0
	if s.senders != nil {
		c.lookupSender(s)
	}
}

// lookupSender names the sender from the datapath's flow records. A panic there
// leaves the sender known by address only: the query is still answered.
func (c *client) lookupSender(s *Server) {
	defer func() {
		if v := recover(); v != nil {
			s.panics.Recovered(panicguard.StageAttribution, v, "client", c.addr)
		}
	}()
	if snd, ok := s.senders(netip.AddrPortFrom(c.addr, c.port), c.proto == protoTCP); ok {
		c.who.Cgroup, c.who.PID, c.egress = snd.Cgroup, snd.PID, snd.Egress
	}
}

// replyTo sends a later response: over UDP (udpReply, per platform), on a TCP
// connection, or to an in-process caller.
type replyTo struct {
	udpReply
	tcp  *tcpConn
	sync chan<- []byte
}

func (r *replyTo) send(b []byte) {
	switch {
	case r.tcp != nil:
		r.tcp.write(b)
	case r.sync != nil:
		r.sync <- append([]byte(nil), b...)
	default:
		r.udpReply.send(b)
	}
}

// bufPools holds response buffers for answers sent later (UDP and TCP sizes).
type bufPools struct{ udp, tcp sync.Pool }

func (p *bufPools) get(size int) *[]byte {
	pool, n := &p.udp, maxUDPResponse
	if size > maxUDPResponse {
		pool, n = &p.tcp, dns.MaxMsgSize
	}
	if b, ok := pool.Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, n)
	return &b
}

func (p *bufPools) put(b *[]byte) {
	if len(*b) > maxUDPResponse {
		p.tcp.Put(b)
	} else {
		p.udp.Put(b)
	}
}
