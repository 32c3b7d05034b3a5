// Package resolver is the DNS server every captured query meets. One query path
// (pipeline.go) serves every transport: UDP readers that block in raw recvmmsg calls,
// keeping their scheduler slots, and answer table and cache hits inline (udp_linux.go), TCP connections
// (tcp.go) and in-process use (ServeDNS). Each query is decoded (decode.go), decided
// once from the name table (decide.go: alt names, autopath, NODATA/NXDOMAIN with SOA,
// PTR, SRV, pod records, the AAAA filter), rendered by the wire encoder
// (encode_wire.go) or, where it declines, the dns.Msg encoder (encode_msg.go), or
// forwarded (forward.go: cache, then the Forwarder, asynchronously and bounded), and
// recorded once (finish.go). Answer semantics are described in docs/resolver.md.
package resolver

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
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

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/talkers"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// Forwarder answers what the table does not know (*upstream.Forwarder).
type Forwarder interface {
	// Cached answers from a fresh cache entry without blocking, or reports false.
	Cached(q *upstream.Query) (upstream.Answer, bool)
	// ForwardAsync calls done exactly once with the answer or an error (SERVFAIL).
	ForwardAsync(q *upstream.Query, done upstream.Waiter)
}

// retryBudgeter is a Forwarder that asks before each retry of an upstream attempt
// (upstream.Forwarder): the workload budgets answer.
type retryBudgeter interface {
	SetRetryBudget(allow func(owner uint64) bool)
}

// TableSource provides the current name table; nil means not published yet.
// *names.Store implements it.
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
	// under the cluster domain instead of forwarding them, and enables autopath for
	// external names.
	Authoritative bool
	// SearchDomains are extra node search domains stripped by autopath,
	// besides <ns>.svc.<domain>, svc.<domain> and <domain>.
	SearchDomains []string
	// PodRecords answers <a-b-c-d>.<ns>.pod.<domain> with the address in
	// the name (CoreDNS's "pods insecure").
	PodRecords bool
	// FilterAAAA answers AAAA queries that the table does not answer with NODATA
	// (the cluster domain's SOA) at once instead of forwarding them: for IPv4-only
	// clusters, where half the queries are AAAA of external names (aaaafilter.go).
	FilterAAAA bool
	// MaxPending bounds the queries waiting for the upstream (default 4096; over it:
	// SERVFAIL at once); MaxPendingPerClient bounds them per client address (default
	// 256; over it: REFUSED at once).
	MaxPending, MaxPendingPerClient int
	// WorkloadBudget is each workload's budget of queries that go upstream (rate
	// and in flight; zero: none). Over it a miss is answered REFUSED at once.
	WorkloadBudget BudgetLimits
	// BudgetOverrides, when set, gives workloads budgets of their own instead of
	// WorkloadBudget (budget.go).
	BudgetOverrides BudgetOverrides
	// MaxTCPConns bounds open TCP connections (default 1024): at the bound the
	// connection idle the longest is closed for a new one.
	MaxTCPConns int
	// Inherited are pre-bound sockets from a predecessor, served instead of
	// binding; OnDequeue is told of every read (see handover.go).
	Inherited []InheritedListener
	OnDequeue func(n int)
	// OnReaders, when set, is called by Start once every address is bound
	// and before the readers start, with the number of UDP readers that keep
	// their Go scheduler slot (P) while they wait in the kernel (0 where
	// readers use the netpoller). The process should then run with
	// GOMAXPROCS of at least that + 1, so one P stays free for everything
	// else (upstream queries, TCP, metrics, GC): a reader's wake-up then
	// never hands its P over nor wakes the runtime's monitor thread (its
	// cost is in bench/RESULTS.md, "Resolver core"). The resolver does
	// not set GOMAXPROCS itself: it is the process's setting (the agent's,
	// internal/agent/tune.go).
	OnReaders func(blocking int)
	// ReaderNice, when not 0, is the nice value of the UDP readers' threads
	// (Linux): each reader is locked to a thread of its own, which gets it,
	// so that a query's wake-up preempts the process's other threads (the
	// collector's workers, a reload) on a shared CPU. Raising a thread's
	// priority takes CAP_SYS_NICE; without it the readers stay as they are.
	// The agent sets it (internal/agent/tune.go).
	ReaderNice int
	// Senders tells who sent from a source address and port (the datapath's
	// flow records, redirect.Flows); nil: senders are known by address only.
	Senders func(src netip.AddrPort, tcp bool) (Sender, bool)
	// Grant is DNS-gated egress's grant step: every answer to a sender in an
	// egress workload (Sender.Egress) is offered to it before it is sent
	// (egressctl.Controller.Grant); nil: no egress.
	Grant Granter
	// Talkers counts every answered query per sender; nil: no counting.
	Talkers *talkers.Counter
	// Tap gets every answered query while someone subscribes; nil: none.
	Tap *tap.Hub
	// Panics counts the panics recovered on the query path (each answered
	// SERVFAIL); nil: they are only logged.
	Panics     *panicguard.Counter
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

const (
	// DefaultTTL is used when Config.TTL is zero.
	DefaultTTL = 30 * time.Second
	// DefaultMaxTCPConns is used when Config.MaxTCPConns is zero.
	DefaultMaxTCPConns = 1024
	tcpIdleTimeout     = 10 * time.Second
	tcpWriteTimeout    = 5 * time.Second
	drainTimeout       = 3 * time.Second
)

// Server is the DNS server. Lifecycle: New (validate), Start (bind and serve), Close.
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
	udpReaders    int // sockets (and reader threads) per UDP address
	maxConns      int

	limits  *pendingLimits
	budgets *budgets // nil: no per-workload budgets
	outBufs bufPools

	inherited  map[string]InheritedListener // by listen address, until Start
	onDequeue  func(n int)
	onReaders  func(blocking int)
	readerNice int
	niceFailed sync.Once

	senders func(src netip.AddrPort, tcp bool) (Sender, bool)
	grant   Granter
	panics  *panicguard.Counter
	talkers *talkers.Counter
	tap     *tap.Hub

	// The AAAA filter (aaaafilter.go): Config.FilterAAAA and its counter.
	filterAAAA   bool
	aaaaFiltered prometheus.Counter

	started  atomic.Bool
	stopping atomic.Bool
	progress atomic.Uint64 // datagrams and connections dequeued from the listening sockets
	readers  sync.WaitGroup
	pending  sync.WaitGroup // queries waiting for the upstream
	wg       sync.WaitGroup // TCP connections
	closeErr error
	closed   sync.Once

	mu    sync.Mutex // guards the fields below (not used on the query path)
	udp   []*udpSock
	tcp   []net.Listener
	conns map[*tcpConn]struct{}
	addrs []string
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
		conns:         map[*tcpConn]struct{}{},
		udpReaders:    runtime.NumCPU(),
		maxConns:      cfg.MaxTCPConns,
		limits:        &pendingLimits{max: int32(cfg.MaxPending), perClient: int32(cfg.MaxPendingPerClient), seed: maphash.MakeSeed()},
		inherited:     map[string]InheritedListener{},
		onDequeue:     cfg.OnDequeue,
		onReaders:     cfg.OnReaders,
		readerNice:    cfg.ReaderNice,
		senders:       cfg.Senders,
		grant:         cfg.Grant,
		panics:        cfg.Panics,
		budgets:       newBudgets(cfg.WorkloadBudget, cfg.BudgetOverrides),
		talkers:       cfg.Talkers,
		tap:           cfg.Tap,
	}
	for _, in := range cfg.Inherited {
		s.inherited[in.Addr] = in
	}
	if rb, ok := cfg.Forwarder.(retryBudgeter); ok && s.budgets != nil {
		rb.SetRetryBudget(s.budgets.retry) // a retry upstream takes a token, as the first attempt did
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.maxConns == 0 {
		s.maxConns = DefaultMaxTCPConns
	}
	if s.limits.max == 0 {
		s.limits.max = DefaultMaxPending
	}
	if s.limits.perClient == 0 {
		s.limits.perClient = DefaultMaxPendingPerClient
	}
	if s.maxConns < 0 || s.limits.max < 0 || s.limits.perClient < 0 {
		return nil, errors.New("resolver: negative connection or pending-query bound")
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
	s.filterAAAA = cfg.FilterAAAA
	if s.aaaaFiltered, err = newFilterMetric(cfg.Registerer); err != nil {
		return nil, fmt.Errorf("resolver: %w", err)
	}
	s.version = "meshdns-ebpf"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		s.version += " " + bi.Main.Version
	}
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

// Start binds every listen address on UDP (one SO_REUSEPORT socket per CPU, each read
// by its own thread) and TCP and starts serving. ctx bounds only the binding. An address
// that cannot be bound is named in the error, and nothing stays bound.
//
// The UDP readers block in the kernel with raw system calls, each keeping its Go
// scheduler slot (P) while it waits: see Config.OnReaders for what the
// process should do about it.
func (s *Server) Start(ctx context.Context) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("resolver: already started")
	}
	defer s.closeInherited() // what no listen address took
	for _, la := range s.listen {
		if err := ctx.Err(); err != nil {
			s.closeSockets()
			return err
		}
		if err := s.bind(la); err != nil {
			s.closeSockets()
			return err
		}
	}
	s.mu.Lock()
	if s.onReaders != nil {
		blocking := 0
		if reusePortSupported {
			blocking = len(s.udp)
		}
		s.onReaders(blocking)
	}
	for _, u := range s.udp {
		s.readers.Add(1)
		go s.readUDP(u)
	}
	for _, l := range s.tcp {
		s.readers.Add(1)
		go s.serveTCP(l)
	}
	s.mu.Unlock()
	s.log.Info("resolver listening", "addrs", s.Addrs(), "udp_sockets_per_addr", s.udpReaders)
	return nil
}

func (s *Server) bind(la listenAddr) error {
	if ok, err := s.adopt(la); ok {
		return err
	}
	attempts := 1
	if la.port == 0 {
		attempts = 20 // UDP picks the port; TCP may find it taken
	}
	var lastErr error
	for range attempts {
		first, port, err := bindUDP(la.host, la.port)
		if err != nil {
			return fmt.Errorf("resolver: listen udp %s: %w", la.raw, err)
		}
		addr := net.JoinHostPort(la.host, strconv.Itoa(port))
		tl, err := listenTCP(addr)
		if err != nil {
			first.close()
			lastErr = fmt.Errorf("resolver: listen tcp %s: %w", la.raw, err)
			continue
		}
		socks := []*udpSock{first}
		for i := 1; i < s.udpReaders && reusePortSupported; i++ {
			u, _, err := bindUDP(la.host, port)
			if err != nil {
				for _, u := range socks {
					u.close()
				}
				tl.Close()
				return fmt.Errorf("resolver: listen udp %s (socket %d): %w", la.raw, i+1, err)
			}
			socks = append(socks, u)
		}
		s.mu.Lock()
		s.udp = append(s.udp, socks...)
		s.tcp = append(s.tcp, tl)
		host := la.host
		if host == "" {
			host = first.localIP()
		}
		s.addrs = append(s.addrs, net.JoinHostPort(host, strconv.Itoa(port)))
		s.mu.Unlock()
		return nil
	}
	return lastErr
}

func (s *Server) closeSockets() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, u := range s.udp {
		u.close()
	}
	for _, l := range s.tcp {
		l.Close()
	}
	for c := range s.conns {
		c.c.Close()
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

// Progress counts the datagrams the UDP readers and the connections the TCP
// listeners have taken off their sockets (one atomic add per batch): a liveness
// signal that costs no syscall.
func (s *Server) Progress() uint64 { return s.progress.Load() }

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

// Shutdown stops the readers (within their 250 ms receive timeout, even when the
// sockets stay open in another process) and the TCP listeners, waits until ctx is done
// for the queries pending upstream to be answered on their still-open sockets, then
// closes the sockets and TCP connections.
func (s *Server) Shutdown(ctx context.Context) error {
	s.closed.Do(func() {
		s.stopping.Store(true)
		s.mu.Lock()
		for _, l := range s.tcp {
			l.Close()
		}
		s.mu.Unlock()
		s.readers.Wait()
		done := make(chan struct{})
		go func() { s.pending.Wait(); close(done) }()
		select {
		case <-done:
		case <-ctx.Done():
			s.closeErr = fmt.Errorf("resolver shutdown: %d queries still waiting for the upstream: %w", s.limits.total.Load(), ctx.Err())
		}
		s.closeSockets() // a later answer finds its socket closed and is dropped
		s.wg.Wait()      // connection goroutines end once their sockets are closed
	})
	return s.closeErr
}

// Close is Shutdown with a 3 s drain. It is idempotent.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	return s.Shutdown(ctx)
}

// ServeDNS implements dns.Handler so the resolver can run inside another miekg/dns
// server or in-process. It runs the same query path and waits for a forwarded answer.
func (s *Server) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	start := time.Now()
	pkt, err := req.Pack()
	if err != nil {
		return
	}
	c := &client{proto: protoUDP}
	if a := w.LocalAddr(); a != nil && strings.HasPrefix(a.Network(), "tcp") {
		c.proto = protoTCP
	}
	if a := w.RemoteAddr(); a != nil {
		if ap, err := netip.ParseAddrPort(a.String()); err == nil {
			c.setSender(s, ap)
		}
	}
	ch := make(chan []byte, 1)
	c.reply.sync = ch
	size := maxUDPResponse
	if c.proto == protoTCP {
		size = dns.MaxMsgSize
	}
	out := make([]byte, size)
	wk := newWorker(s)
	b := wk.serve(pkt, out, c, start)
	if b == nil {
		if !wk.req.pending {
			return // dropped
		}
		b = <-ch
	}
	if _, err := w.Write(b); err != nil {
		s.log.Debug("write response", "err", err)
	}
}
