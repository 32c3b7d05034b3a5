// Package dnsfake is the one fake nameserver of the project's tests and benchmarks: a
// DNS server on UDP and TCP (one port) whose answers the caller scripts, which records
// the queries it sees and can be slowed down. It never forwards anywhere.
package dnsfake

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// Respond returns the messages to send for req; nil stays silent (a black hole). Over
// TCP only the first is sent. It runs in its own goroutine per query.
type Respond func(proto string, req *dns.Msg) []*dns.Msg

// Query is one query the server saw.
type Query struct {
	Proto   string // "udp" or "tcp"
	Source  netip.AddrPort
	ID      uint16
	Name    string // lower-case FQDN
	Type    uint16
	DO, CD  bool
	UDPSize uint16 // 0 = no OPT
}

// Config configures a Server.
type Config struct {
	// Addr is "ip:port"; port 0 picks a free port, the same for UDP and TCP.
	Addr    string
	Respond Respond
	// NoRecord keeps no list of queries (for benchmarks); Count still counts.
	NoRecord bool
}

// Server is a running fake nameserver.
type Server struct {
	Addr netip.AddrPort

	respond  atomic.Pointer[Respond]
	delay    atomic.Int64
	count    atomic.Int64
	noRecord bool
	pc       *net.UDPConn
	ln       net.Listener
	mu       sync.Mutex
	seen     []Query
	closed   atomic.Bool
	wg       sync.WaitGroup

	// A resolver's dequeue side, for datapath tests that use the server as one.
	onRead    atomic.Pointer[func(n int)]
	readDelay atomic.Int64  // nanoseconds each read waits before it reads
	frozen    chan struct{} // under mu; non-nil while frozen: reads wait until it is closed
}

// Listen starts a server. Close stops it.
func Listen(cfg Config) (*Server, error) {
	host, port, err := net.SplitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("fake DNS address %q: %w", cfg.Addr, err)
	}
	s := &Server{noRecord: cfg.NoRecord}
	s.SetRespond(cfg.Respond)
	for attempt := 0; ; attempt++ {
		pc, err := net.ListenPacket("udp", net.JoinHostPort(host, port))
		if err != nil {
			return nil, fmt.Errorf("listen udp %s: %w", cfg.Addr, err)
		}
		bound := pc.LocalAddr().(*net.UDPAddr)
		// Plain TCP, not Go's default MPTCP: datapath tests register the listener
		// as a resolver's, and a SOCKMAP takes TCP sockets only.
		var lc net.ListenConfig
		lc.SetMultipathTCP(false)
		ln, err := lc.Listen(context.Background(), "tcp", net.JoinHostPort(host, strconv.Itoa(bound.Port)))
		if err != nil {
			pc.Close()
			if port == "0" && attempt < 20 {
				continue // the TCP port of the same number was taken; pick again
			}
			return nil, fmt.Errorf("listen tcp %s: %w", cfg.Addr, err)
		}
		s.pc, s.ln = pc.(*net.UDPConn), ln
		ap := bound.AddrPort()
		s.Addr = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
		break
	}
	s.wg.Add(2)
	go s.serveUDP()
	go s.serveTCP()
	return s, nil
}

// SetRespond replaces the answering function.
func (s *Server) SetRespond(fn Respond) { s.respond.Store(&fn) }

// SetDelay makes every answer wait d first.
func (s *Server) SetDelay(d time.Duration) { s.delay.Store(int64(d)) }

// Conns returns the server's UDP socket and TCP listener (datapath tests
// register them as a resolver's sockets).
func (s *Server) Conns() (*net.UDPConn, *net.TCPListener) {
	return s.pc, s.ln.(*net.TCPListener)
}

// OnRead sets a function called with 1 for every message the server reads (UDP
// datagrams, empty ones included, and TCP messages) before it handles it: a
// resolver's progress signal.
func (s *Server) OnRead(fn func(n int)) { s.onRead.Store(&fn) }

// SetReadDelay makes the server wait d before each read from its sockets: a
// resolver slow to dequeue (CPU-starved) that still makes progress.
func (s *Server) SetReadDelay(d time.Duration) { s.readDelay.Store(int64(d)) }

// Freeze stops the server reading its sockets (queries queue up, as with a
// SIGSTOPped resolver) until the returned function is called.
func (s *Server) Freeze() (thaw func()) {
	ch := make(chan struct{})
	s.mu.Lock()
	s.frozen = ch
	s.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			s.frozen = nil
			s.mu.Unlock()
			close(ch)
		})
	}
}

// beforeRead waits for the read delay and while frozen.
func (s *Server) beforeRead() {
	if d := s.readDelay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
	s.mu.Lock()
	ch := s.frozen
	s.mu.Unlock()
	if ch != nil {
		<-ch
	}
}

func (s *Server) read() {
	if fn := s.onRead.Load(); fn != nil {
		(*fn)(1)
	}
}

// Close stops the server and waits for its listeners (not for delayed answers).
func (s *Server) Close() {
	if s.closed.CompareAndSwap(false, true) {
		s.pc.Close()
		s.ln.Close()
		s.wg.Wait()
	}
}

// Queries returns the queries seen so far.
func (s *Server) Queries() []Query {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Query(nil), s.seen...)
}

// Count returns how many queries were seen.
func (s *Server) Count() int64 { return s.count.Load() }

// Reset forgets the queries seen so far.
func (s *Server) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seen = nil
	s.count.Store(0)
}

func (s *Server) record(proto string, src netip.AddrPort, req *dns.Msg) {
	s.count.Add(1)
	if s.noRecord {
		return
	}
	q := Query{Proto: proto, Source: src, ID: req.Id, CD: req.CheckingDisabled}
	if len(req.Question) > 0 {
		q.Name, q.Type = strings.ToLower(req.Question[0].Name), req.Question[0].Qtype
	}
	if opt := req.IsEdns0(); opt != nil {
		q.DO, q.UDPSize = opt.Do(), opt.UDPSize()
	}
	s.mu.Lock()
	s.seen = append(s.seen, q)
	s.mu.Unlock()
}

func (s *Server) answers(proto string, req *dns.Msg) []*dns.Msg {
	if d := time.Duration(s.delay.Load()); d > 0 {
		time.Sleep(d)
	}
	return (*s.respond.Load())(proto, req)
}

func (s *Server) serveUDP() {
	defer s.wg.Done()
	buf := make([]byte, 65535)
	for {
		s.beforeRead()
		n, src, err := s.pc.ReadFromUDPAddrPort(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		s.read()
		req := new(dns.Msg)
		if err := req.Unpack(buf[:n]); err != nil {
			continue
		}
		s.record("udp", netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), req)
		go func() {
			for _, m := range s.answers("udp", req) {
				b, err := m.Pack()
				if err != nil {
					continue
				}
				_, _ = s.pc.WriteToUDPAddrPort(b, src)
			}
		}()
	}
}

func (s *Server) serveTCP() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		go s.serveConn(c)
	}
}

func (s *Server) serveConn(c net.Conn) {
	defer c.Close()
	src, _ := netip.ParseAddrPort(c.RemoteAddr().String())
	for {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		var l [2]byte
		s.beforeRead()
		if _, err := io.ReadFull(c, l[:]); err != nil {
			return
		}
		b := make([]byte, binary.BigEndian.Uint16(l[:]))
		if _, err := io.ReadFull(c, b); err != nil {
			return
		}
		s.read()
		req := new(dns.Msg)
		if err := req.Unpack(b); err != nil {
			return
		}
		s.record("tcp", netip.AddrPortFrom(src.Addr().Unmap(), src.Port()), req)
		ms := s.answers("tcp", req)
		if len(ms) == 0 {
			return
		}
		out, err := ms[0].Pack()
		if err == nil && len(out) > dns.MaxMsgSize {
			ms[0].Compress = true // the caller asked for a lot: make it fit if it can
			out, err = ms[0].Pack()
		}
		if err != nil || len(out) > dns.MaxMsgSize {
			return
		}
		if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(out))), out...)); err != nil {
			return
		}
	}
}

// Records answers A and AAAA queries for the names in records (by address family),
// NOERROR/NODATA for their other types, and NXDOMAIN with an SOA for every other name.
// Every record and the SOA carry ttl. FORMERR for anything but one question. The map is
// read on each query and may be changed by the caller under its own lock through get.
func Records(ttl uint32, get func(name string) ([]netip.Addr, bool)) Respond {
	return func(_ string, req *dns.Msg) []*dns.Msg {
		resp := new(dns.Msg)
		if len(req.Question) != 1 {
			return []*dns.Msg{resp.SetRcode(req, dns.RcodeFormatError)}
		}
		resp.SetReply(req)
		resp.RecursionAvailable = true
		q := req.Question[0]
		ips, ok := get(strings.ToLower(q.Name))
		if !ok {
			resp.Rcode = dns.RcodeNameError
			resp.Ns = []dns.RR{SOA(".", ttl)}
		}
		for _, ip := range ips {
			hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: ttl}
			switch {
			case q.Qtype == dns.TypeA && ip.Is4():
				hdr.Rrtype = dns.TypeA
				resp.Answer = append(resp.Answer, &dns.A{Hdr: hdr, A: ip.AsSlice()})
			case q.Qtype == dns.TypeAAAA && ip.Is6():
				hdr.Rrtype = dns.TypeAAAA
				resp.Answer = append(resp.Answer, &dns.AAAA{Hdr: hdr, AAAA: ip.AsSlice()})
			}
		}
		if ok && len(resp.Answer) == 0 {
			resp.Ns = []dns.RR{SOA(".", ttl)}
		}
		return []*dns.Msg{resp}
	}
}

// SOA returns an SOA record for zone whose TTL and minimum are ttl.
func SOA(zone string, ttl uint32) *dns.SOA {
	return &dns.SOA{
		Hdr: dns.RR_Header{Name: dns.Fqdn(zone), Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: ttl},
		Ns:  "fake.test.", Mbox: "hostmaster.fake.test.", Serial: 1, Refresh: 60, Retry: 60, Expire: 60, Minttl: ttl,
	}
}

// RateLimited wraps fn as an upstream that throttles: each answer waits latency, and
// at most perSecond queries a second are answered (a token bucket holding one tenth
// of a second's worth); the rest are dropped without a reply, as cloud resolvers do
// over their limit. Health probes (the root name) count like any query.
func RateLimited(fn Respond, perSecond int, latency time.Duration) Respond {
	var mu sync.Mutex
	burst := max(float64(perSecond)/10, 1)
	tokens, last := burst, time.Now()
	return func(proto string, req *dns.Msg) []*dns.Msg {
		mu.Lock()
		now := time.Now()
		tokens = min(burst, tokens+now.Sub(last).Seconds()*float64(perSecond))
		last = now
		ok := tokens >= 1
		if ok {
			tokens--
		}
		mu.Unlock()
		if !ok {
			return nil
		}
		time.Sleep(latency)
		return fn(proto, req)
	}
}
