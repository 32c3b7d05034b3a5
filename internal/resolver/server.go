// Package resolver is the DNS server every captured query meets: UDP and
// TCP listeners, a handler that answers mesh names from the name table
// (alt names, autopath, NODATA/NXDOMAIN with SOA, PTR, SRV, shuffling,
// EDNS and truncation) and hands everything else to a Forwarder, plus its
// Prometheus metrics. Answer semantics are described in docs/resolver.md.
package resolver

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/nametable"
)

// Forwarder answers what the table does not know. source is "upstream",
// "cache" or "stale"; err != nil means the client gets SERVFAIL.
type Forwarder interface {
	Forward(ctx context.Context, req *dns.Msg) (resp *dns.Msg, source string, err error)
}

// TableSource provides the current name table; nil means not loaded yet.
// *nametable.Watcher implements it.
type TableSource interface {
	Table() *nametable.Table
}

// Config configures a Server.
type Config struct {
	// Listen addresses "ip:port", each served on UDP and TCP. Port 0 picks
	// a free port (the same for UDP and TCP); see Server.Addrs.
	Listen    []string
	Table     TableSource
	Forwarder Forwarder
	// TTL of table answers and of the SOA in negative answers (default 30s).
	TTL time.Duration
	// ClusterDomain (default "cluster.local") must match the table's.
	ClusterDomain string
	// Authoritative answers NXDOMAIN (with SOA) locally for unknown names
	// under the cluster domain instead of forwarding them.
	Authoritative bool
	// SearchDomains are extra node search domains stripped by autopath,
	// besides <ns>.svc.<domain>, svc.<domain> and <domain>.
	SearchDomains []string
	// PodRecords answers <a-b-c-d>.<ns>.pod.<domain> with the address in
	// the name (CoreDNS's "pods insecure").
	PodRecords bool
	// Inherited are pre-bound sockets from a predecessor, served instead of
	// binding; OnDequeue is told of every read (see handover.go).
	Inherited  []InheritedListener
	OnDequeue  func(n int)
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

const (
	// DefaultTTL is used when Config.TTL is zero.
	DefaultTTL = 30 * time.Second
	// maxForwardInflight caps concurrently forwarded UDP queries; beyond
	// it clients get SERVFAIL rather than an unbounded goroutine pile.
	maxForwardInflight = 10000
	tcpIdleTimeout     = 10 * time.Second
	tcpWriteTimeout    = 5 * time.Second
)

// Server is the DNS server. Create it with New, then Start.
type Server struct {
	tables        TableSource
	fwd           Forwarder
	ttl           uint32
	domain        string
	authoritative bool
	searchDomains []string
	dotDomain     string   // "." + domain
	dotSearch     []string // "." + each search domain
	podRecords    bool
	dotPod        string // ".pod." + domain
	log           *slog.Logger
	m             *metrics
	version       string
	listen        []listenAddr
	udpSockets    int
	inherited     map[string]InheritedListener
	onDequeue     func(n int)
	lastRead      atomic.Int64 // unix ns of the last read (Drain's quiet period)
	draining      atomic.Bool

	ctx    context.Context
	cancel context.CancelFunc

	started  atomic.Bool
	stopping atomic.Bool
	inflight atomic.Int64
	wg       sync.WaitGroup

	mu    sync.Mutex // guards the fields below (not used on the query path)
	udp   []*net.UDPConn
	tcp   []net.Listener
	conns map[net.Conn]struct{}
	addrs []string

	bufs sync.Pool // *[]byte of dns.MaxMsgSize
}

type listenAddr struct {
	raw  string
	host string // "" or an IP literal
	port int
}

// New validates cfg and creates a server. It binds nothing yet.
func New(cfg Config) (*Server, error) {
	if len(cfg.Listen) == 0 {
		return nil, errors.New("resolver: no listen address")
	}
	if cfg.Table == nil {
		return nil, errors.New("resolver: Table is nil")
	}
	if cfg.Forwarder == nil {
		return nil, errors.New("resolver: Forwarder is nil")
	}
	s := &Server{
		tables:        cfg.Table,
		fwd:           cfg.Forwarder,
		authoritative: cfg.Authoritative,
		log:           cfg.Logger,
		conns:         map[net.Conn]struct{}{},
		udpSockets:    runtime.GOMAXPROCS(0),
		inherited:     map[string]InheritedListener{},
		onDequeue:     cfg.OnDequeue,
	}
	for _, in := range cfg.Inherited {
		s.inherited[in.Addr] = in
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	for _, l := range cfg.Listen {
		la, err := parseListen(l)
		if err != nil {
			return nil, err
		}
		s.listen = append(s.listen, la)
	}
	ttl := cfg.TTL
	if ttl == 0 {
		ttl = DefaultTTL
	}
	if ttl < time.Second || ttl > 24*time.Hour {
		return nil, fmt.Errorf("resolver: TTL %s out of range 1s-24h", ttl)
	}
	s.ttl = uint32(ttl / time.Second)
	domain := cfg.ClusterDomain
	if domain == "" {
		domain = nametable.DefaultClusterDomain
	}
	d, err := normDomain(domain)
	if err != nil {
		return nil, fmt.Errorf("resolver: cluster domain: %w", err)
	}
	s.domain = d
	s.dotDomain = "." + d
	s.podRecords = cfg.PodRecords
	s.dotPod = ".pod." + d
	for _, sd := range cfg.SearchDomains {
		d, err := normDomain(sd)
		if err != nil {
			return nil, fmt.Errorf("resolver: search domain: %w", err)
		}
		s.searchDomains = append(s.searchDomains, d)
		s.dotSearch = append(s.dotSearch, "."+d)
	}
	s.m, err = newMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("resolver: register metrics: %w", err)
	}
	s.version = "meshdns-ebpf"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		s.version += " " + bi.Main.Version
	}
	s.bufs.New = func() any { b := make([]byte, dns.MaxMsgSize); return &b }
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

func normDomain(d string) (string, error) {
	n := strings.ToLower(strings.Trim(strings.TrimSpace(d), "."))
	if n == "" {
		return "", fmt.Errorf("%q is empty", d)
	}
	if _, ok := dns.IsDomainName(n); !ok || strings.ContainsAny(n, "*\\ ") {
		return "", fmt.Errorf("%q is not a domain name", d)
	}
	return n + ".", nil
}

func parseListen(s string) (listenAddr, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return listenAddr{}, fmt.Errorf("resolver: listen address %q: want ip:port: %w", s, err)
	}
	if host != "" {
		if _, err := netip.ParseAddr(host); err != nil {
			return listenAddr{}, fmt.Errorf("resolver: listen address %q: %q is not an IP address", s, host)
		}
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return listenAddr{}, fmt.Errorf("resolver: listen address %q: port %q is not a number 0-65535", s, port)
	}
	return listenAddr{raw: s, host: host, port: int(p)}, nil
}

// Start binds every listen address on UDP (one SO_REUSEPORT socket per
// CPU) and TCP and starts serving. ctx bounds only the binding; stop the
// server with Shutdown. An address that cannot be bound is named in the
// error, and nothing stays bound.
func (s *Server) Start(ctx context.Context) error {
	if s.started.Load() {
		return errors.New("resolver: already started")
	}
	for _, la := range s.listen {
		if err := ctx.Err(); err != nil {
			s.closeAll()
			return err
		}
		if err := s.bind(ctx, la); err != nil {
			s.closeAll()
			s.closeInherited()
			return err
		}
	}
	s.closeInherited()
	s.mu.Lock()
	for _, c := range s.udp {
		pktinfo := setPktinfo(c)
		s.wg.Add(1)
		go s.serveUDP(c, pktinfo)
	}
	for _, l := range s.tcp {
		s.wg.Add(1)
		go s.serveTCP(l)
	}
	s.mu.Unlock()
	s.started.Store(true)
	s.log.Info("resolver listening", "addrs", s.Addrs(), "udp_sockets_per_addr", s.udpSockets)
	return nil
}

func (s *Server) bind(ctx context.Context, la listenAddr) error {
	if ok, err := s.adopt(la); ok {
		return err
	}
	lc := listenConfig()
	attempts := 1
	if la.port == 0 {
		attempts = 20 // UDP picks the port; TCP may find it taken
	}
	var lastErr error
	for range attempts {
		first, err := lc.ListenPacket(ctx, "udp", net.JoinHostPort(la.host, strconv.Itoa(la.port)))
		if err != nil {
			return fmt.Errorf("resolver: listen udp %s: %w", la.raw, err)
		}
		uc := first.(*net.UDPConn)
		bound := uc.LocalAddr().(*net.UDPAddr)
		addr := net.JoinHostPort(la.host, strconv.Itoa(bound.Port))
		tl, err := lc.Listen(ctx, "tcp", addr)
		if err != nil {
			uc.Close()
			lastErr = fmt.Errorf("resolver: listen tcp %s: %w", la.raw, err)
			continue
		}
		conns := []*net.UDPConn{uc}
		for i := 1; i < s.udpSockets && reusePortSupported; i++ {
			c, err := lc.ListenPacket(ctx, "udp", addr)
			if err != nil {
				for _, c := range conns {
					c.Close()
				}
				tl.Close()
				return fmt.Errorf("resolver: listen udp %s (socket %d): %w", la.raw, i+1, err)
			}
			conns = append(conns, c.(*net.UDPConn))
		}
		s.mu.Lock()
		s.udp = append(s.udp, conns...)
		s.tcp = append(s.tcp, tl)
		host := la.host
		if host == "" {
			host = bound.IP.String()
		}
		s.addrs = append(s.addrs, net.JoinHostPort(host, strconv.Itoa(bound.Port)))
		s.mu.Unlock()
		return nil
	}
	return lastErr
}

func (s *Server) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.udp {
		c.Close()
	}
	for _, l := range s.tcp {
		l.Close()
	}
	for c := range s.conns {
		c.Close()
	}
	s.udp, s.tcp, s.addrs = nil, nil, nil
}

// Addrs returns the bound addresses ("ip:port"), one per listen address,
// in Config.Listen order.
func (s *Server) Addrs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.addrs...)
}

// Ready returns nil once the listeners are up and the first name table
// load has succeeded, otherwise an error saying why not.
func (s *Server) Ready() error {
	if s.stopping.Load() {
		return errors.New("resolver is shutting down")
	}
	if !s.started.Load() {
		return errors.New("resolver listeners are not started")
	}
	t := s.tables.Table()
	if t == nil {
		return errors.New("name table not published yet")
	}
	if t.Domain() != s.domain {
		return fmt.Errorf("name table is built for cluster domain %q but the resolver serves %q", t.Domain(), s.domain)
	}
	return nil
}

// Shutdown closes the listeners and open TCP connections and waits for
// the serving goroutines (and in-flight forwards) until ctx is done.
func (s *Server) Shutdown(ctx context.Context) error {
	s.stopping.Store(true)
	s.closeAll()
	s.cancel()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("resolver shutdown: %w", ctx.Err())
	}
}

// ServeDNS implements dns.Handler so the resolver can run inside another
// miekg/dns server or in-process.
func (s *Server) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	start := time.Now()
	ri := reqInfo{proto: protoUDP}
	if a := w.LocalAddr(); a != nil && strings.HasPrefix(a.Network(), "tcp") {
		ri.proto = protoTCP
	}
	if ap, err := netip.ParseAddrPort(addrString(w.RemoteAddr())); err == nil {
		ri.client = ap.Addr().Unmap()
	}
	resp, src := s.respond(s.ctx, req, &ri)
	if resp == nil {
		return
	}
	if err := w.WriteMsg(resp); err != nil {
		s.log.Debug("write response", "err", err)
	}
	s.observe(resp, src, start)
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}

// respond runs the whole handler on an unpacked request: local answer or
// forward, then OPT and truncation. nil means do not answer.
func (s *Server) respond(ctx context.Context, req *dns.Msg, ri *reqInfo) (*dns.Msg, source) {
	qt := uint16(0)
	if len(req.Question) > 0 {
		qt = req.Question[0].Qtype
	}
	s.m.requests[ri.proto][qtypeIndex(qt)].Inc()
	resp, fwd := s.local(req, ri)
	src := srcTable
	switch {
	case fwd:
		resp, src = s.forward(ctx, req, ri)
	case resp == nil:
		s.m.dropped.Inc()
		return nil, srcError
	default:
		switch resp.Rcode {
		case dns.RcodeFormatError, dns.RcodeNotImplemented, dns.RcodeRefused, dns.RcodeBadVers:
			src = srcError
		}
	}
	s.finish(resp, ri)
	return resp, src
}

func (s *Server) observe(resp *dns.Msg, src source, start time.Time) {
	s.m.responses[rcodeIndex(resp.Rcode)][src].Inc()
	s.m.duration[src].Observe(time.Since(start).Seconds())
}

// serveUDP reads one socket. Table answers are produced inline (no
// goroutine, no lock); forwarded queries run in their own goroutine with
// their own buffers.
func (s *Server) serveUDP(c *net.UDPConn, pktinfo bool) {
	defer s.wg.Done()
	bp := s.bufs.Get().(*[]byte)
	out := make([]byte, dns.MaxMsgSize)
	var oob, oobOut []byte
	if pktinfo {
		oob = make([]byte, 128)
		oobOut = make([]byte, 0, 128)
	}
	fp := newFastPath(s)
	for {
		buf := *bp
		var n, oobn int
		var from netip.AddrPort
		var err error
		if pktinfo {
			n, oobn, _, from, err = c.ReadMsgUDPAddrPort(buf, oob)
		} else {
			n, from, err = c.ReadFromUDPAddrPort(buf)
		}
		if err != nil {
			if errors.Is(err, net.ErrClosed) || (s.draining.Load() && isTimeout(err)) {
				s.bufs.Put(bp)
				return
			}
			s.log.Debug("udp read", "err", err)
			continue
		}
		s.dequeued(1)
		if n == 0 {
			continue // a liveness probe
		}
		start := time.Now()
		var reply []byte
		if pktinfo {
			reply = replyPktinfo(oob[:oobn], oobOut[:0])
		}
		if n < 12 {
			s.m.dropped.Inc() // no header: there is no ID to answer to
			continue
		}
		pkt := buf[:n]
		if resp, src, ok := fp.answer(pkt, out, from.Addr().Unmap()); ok {
			s.writeUDP(c, resp, reply, from)
			s.m.duration[src].Observe(time.Since(start).Seconds())
			continue
		}
		req := new(dns.Msg)
		if err := req.Unpack(pkt); err != nil {
			if resp := formErr(pkt, out); resp != nil {
				s.m.requests[protoUDP][nQtypes-1].Inc()
				s.writeUDP(c, resp, reply, from)
				s.m.responses[rcodeIndex(dns.RcodeFormatError)][srcError].Inc()
				s.m.duration[srcError].Observe(time.Since(start).Seconds())
			} else {
				s.m.dropped.Inc()
			}
			continue
		}
		ri := reqInfo{proto: protoUDP, client: from.Addr().Unmap()}
		qt := uint16(0)
		if len(req.Question) > 0 {
			qt = req.Question[0].Qtype
		}
		resp, fwd := s.local(req, &ri)
		if !fwd {
			s.m.requests[protoUDP][qtypeIndex(qt)].Inc()
			if resp == nil {
				s.m.dropped.Inc()
				continue
			}
			src := srcTable
			switch resp.Rcode {
			case dns.RcodeFormatError, dns.RcodeNotImplemented, dns.RcodeRefused, dns.RcodeBadVers:
				src = srcError
			}
			s.finish(resp, &ri)
			s.sendUDP(c, resp, out, reply, from)
			s.observe(resp, src, start)
			continue
		}
		s.m.requests[protoUDP][qtypeIndex(qt)].Inc()
		if s.inflight.Add(1) > maxForwardInflight {
			s.inflight.Add(-1)
			resp := s.servfail(req)
			s.finish(resp, &ri)
			s.sendUDP(c, resp, out, reply, from)
			s.observe(resp, srcError, start)
			continue
		}
		// Hand the read buffer to the forward goroutine (the request may
		// alias it) and take a fresh one.
		s.wg.Add(1)
		go s.forwardUDP(c, req, ri, from, append([]byte(nil), reply...), start, bp)
		bp = s.bufs.Get().(*[]byte)
	}
}

func (s *Server) forwardUDP(c *net.UDPConn, req *dns.Msg, ri reqInfo, from netip.AddrPort, reply []byte, start time.Time, bp *[]byte) {
	defer s.wg.Done()
	defer s.inflight.Add(-1)
	resp, src := s.forward(s.ctx, req, &ri)
	s.finish(resp, &ri)
	s.sendUDP(c, resp, *bp, reply, from)
	s.observe(resp, src, start)
	s.bufs.Put(bp)
}

func (s *Server) servfail(req *dns.Msg) *dns.Msg {
	m := new(dns.Msg)
	m.SetRcode(req, dns.RcodeServerFailure)
	m.RecursionAvailable = true
	return m
}

func (s *Server) sendUDP(c *net.UDPConn, resp *dns.Msg, out, reply []byte, to netip.AddrPort) {
	b, err := resp.PackBuffer(out)
	if err != nil {
		s.log.Warn("pack response", "err", err, "name", firstName(resp))
		b = headerOnly(resp.Id, resp.Opcode, dns.RcodeServerFailure, out)
	}
	s.writeUDP(c, b, reply, to)
}

func (s *Server) writeUDP(c *net.UDPConn, b, oob []byte, to netip.AddrPort) {
	var err error
	if oob != nil {
		_, _, err = c.WriteMsgUDPAddrPort(b, oob, to)
	} else {
		_, err = c.WriteToUDPAddrPort(b, to)
	}
	if err != nil && !errors.Is(err, net.ErrClosed) {
		s.log.Debug("udp write", "to", to, "err", err)
	}
}

func firstName(m *dns.Msg) string {
	if len(m.Question) > 0 {
		return m.Question[0].Name
	}
	return ""
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

// formErr answers a packet that does not unpack: FORMERR echoing ID and
// opcode. A FORMERR response sent to us is not answered (nil): two servers
// would otherwise bounce FORMERRs forever.
func formErr(pkt, out []byte) []byte {
	if pkt[2]&0x80 != 0 && pkt[3]&0xf == dns.RcodeFormatError {
		return nil
	}
	b := headerOnly(binary.BigEndian.Uint16(pkt), int(pkt[2]>>3&0xf), dns.RcodeFormatError, out)
	b[2] |= pkt[2] & 0x01 // RD
	return b
}

func (s *Server) serveTCP(l net.Listener) {
	defer s.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || (s.draining.Load() && isTimeout(err)) {
				return
			}
			s.log.Debug("tcp accept", "err", err)
			time.Sleep(5 * time.Millisecond)
			continue
		}
		s.mu.Lock()
		if s.stopping.Load() {
			s.mu.Unlock()
			c.Close()
			continue
		}
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.dequeued(1)
		s.wg.Add(1)
		go s.serveConn(c)
	}
}

// serveConn answers the queries of one TCP connection in order (RFC 7766
// pipelining is allowed; answers come back in request order).
func (s *Server) serveConn(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.Close()
	}()
	var client netip.Addr
	if ap, err := netip.ParseAddrPort(c.RemoteAddr().String()); err == nil {
		client = ap.Addr().Unmap()
	}
	bp := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(bp)
	in := *bp
	out := make([]byte, 2+dns.MaxMsgSize)
	var hdr [2]byte
	for {
		idle := tcpIdleTimeout
		if s.draining.Load() {
			idle = drainIdle
		}
		_ = c.SetReadDeadline(time.Now().Add(idle))
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint16(hdr[:]))
		if _, err := io.ReadFull(c, in[:n]); err != nil {
			return
		}
		start := time.Now()
		if n < 12 {
			s.m.dropped.Inc()
			return // no ID to answer to; the stream is unusable
		}
		var b []byte
		var resp *dns.Msg
		src := srcError
		req := new(dns.Msg)
		if err := req.Unpack(in[:n]); err != nil {
			b = formErr(in[:n], out[2:])
			s.m.requests[protoTCP][nQtypes-1].Inc()
			if b == nil {
				s.m.dropped.Inc()
				continue
			}
			s.m.responses[rcodeIndex(dns.RcodeFormatError)][srcError].Inc()
			s.m.duration[srcError].Observe(time.Since(start).Seconds())
		} else {
			ri := reqInfo{proto: protoTCP, client: client}
			resp, src = s.respond(s.ctx, req, &ri)
			if resp == nil {
				continue
			}
			var err error
			b, err = resp.PackBuffer(out[2:])
			if err != nil {
				s.log.Warn("pack response", "err", err, "name", firstName(resp))
				b = headerOnly(resp.Id, resp.Opcode, dns.RcodeServerFailure, out[2:])
			}
			s.observe(resp, src, start)
		}
		var msg []byte
		if &b[0] == &out[2] {
			msg = out[:2+len(b)]
		} else {
			msg = append(make([]byte, 2, 2+len(b)), b...)
		}
		binary.BigEndian.PutUint16(msg, uint16(len(b)))
		_ = c.SetWriteDeadline(time.Now().Add(tcpWriteTimeout))
		if _, err := c.Write(msg); err != nil {
			return
		}
	}
}
