// Package upstream forwards the queries the resolver does not answer from its name table
// to the upstream nameservers, with a cache in front.
//
// The cache is positive and negative (RFC 2308), bounded and sharded, keyed on the
// lower-cased name, type, class and the DO and CD bits; it serves stale answers
// (RFC 8767) when every upstream fails, refreshes popular entries before they expire,
// and coalesces identical concurrent misses into one upstream query. Upstreams are
// health-checked: a failing one is skipped at once and probed in the background until it
// answers again. Every upstream query uses a new connected socket (random source port)
// carrying SO_MARK, a random query ID, an EDNS buffer of 1232 bytes, and is retried over
// TCP when the UDP answer is truncated; replies that do not match the query are dropped.
package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
)

// Sources of an answer, as returned by Forward.
const (
	SourceCache    = "cache"
	SourceUpstream = "upstream"
	SourceStale    = "stale"
)

var (
	// ErrOverloaded is returned when MaxInFlight upstream queries are already running.
	ErrOverloaded = errors.New("too many upstream queries in flight")
	// ErrAllFailed is returned when no upstream answered within the deadline.
	ErrAllFailed = errors.New("all upstreams failed")
	// ErrClosed is returned by Forward after Close.
	ErrClosed = errors.New("forwarder closed")
)

// ServerHealth is the state of one upstream, for `status`.
type ServerHealth struct {
	Server              netip.AddrPort
	Healthy             bool
	ConsecutiveFailures uint32
	LastError           string    // last failure, empty if none yet
	Since               time.Time // last change of Healthy (zero: healthy since start)
}

// server is one upstream and its health.
type server struct {
	addr    netip.AddrPort
	addrStr string
	name    string // metric label
	m       *serverMetrics

	healthy atomic.Bool
	fails   atomic.Uint32
	mu      sync.Mutex
	lastErr string
	since   time.Time
}

// Forwarder answers queries from its cache or its upstreams. It is safe for concurrent
// use.
type Forwarder struct {
	cfg     Config
	log     *slog.Logger
	servers []*server
	cache   *cache // nil when disabled
	m       *metrics
	dialer  net.Dialer
	stale   int64 // StaleTTL in ns, 0 = no serve-stale

	// now returns the clock in nanoseconds; tests replace it.
	now func() int64

	ctx    context.Context // ends at Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
	wake   chan struct{} // an upstream turned unhealthy

	inflight atomic.Int64
	flightMu sync.Mutex
	flights  map[cacheKey]*flight

	startOnce sync.Once
	closeOnce sync.Once
}

// flight is one upstream resolution shared by every identical concurrent miss.
type flight struct {
	done chan struct{}
	e    *entry
	err  error
}

// New validates cfg, applies defaults, checks that the socket mark can be set, and
// registers the metrics. Call Start to run the health checks.
func New(cfg Config) (*Forwarder, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("upstream config: %w", err)
	}
	if err := checkMark(cfg.Mark); err != nil {
		return nil, err
	}
	f := &Forwarder{
		cfg:     cfg,
		log:     cfg.Logger,
		dialer:  net.Dialer{Control: control(cfg.Mark)},
		now:     func() int64 { return time.Now().UnixNano() },
		wake:    make(chan struct{}, 1),
		flights: make(map[cacheKey]*flight),
	}
	if cfg.StaleTTL > 0 {
		f.stale = int64(cfg.StaleTTL)
	}
	if cfg.CacheSize > 0 {
		f.cache = newCache(cfg.CacheSize, max(cfg.StaleTTL, 0))
	}
	for _, a := range cfg.Servers {
		s := &server{addr: a, addrStr: a.String(), name: a.String()}
		s.healthy.Store(true)
		f.servers = append(f.servers, s)
	}
	m, err := newMetrics(cfg.Registerer, f.cache, f.servers)
	if err != nil {
		return nil, err
	}
	f.m = m
	f.ctx, f.cancel = context.WithCancel(context.Background())
	return f, nil
}

// Start runs the background health checks until ctx ends or Close is called. Prefetches
// run without Start; an unhealthy upstream is only probed (and so brought back) while
// Start runs.
func (f *Forwarder) Start(ctx context.Context) {
	f.startOnce.Do(func() {
		f.goBackground(func() { f.healthLoop(ctx) })
	})
}

// Close stops the background work and unregisters the metrics.
func (f *Forwarder) Close() error {
	f.closeOnce.Do(func() {
		f.flightMu.Lock() // no goBackground after this
		f.cancel()
		f.flightMu.Unlock()
		f.wg.Wait()
		if f.cfg.Registerer != nil {
			for _, c := range f.m.collectors {
				f.cfg.Registerer.Unregister(c)
			}
		}
	})
	return nil
}

// Healthy returns the state of every upstream, in configuration order.
func (f *Forwarder) Healthy() []ServerHealth {
	out := make([]ServerHealth, 0, len(f.servers))
	for _, s := range f.servers {
		s.mu.Lock()
		out = append(out, ServerHealth{
			Server:              s.addr,
			Healthy:             s.healthy.Load(),
			ConsecutiveFailures: s.fails.Load(),
			LastError:           s.lastErr,
			Since:               s.since,
		})
		s.mu.Unlock()
	}
	return out
}

// Forward answers req from the cache or the upstreams. The returned message answers req:
// same Id, the question exactly as the client asked it (0x20 case echoed), the client's
// RD and CD bits, no OPT record (the caller adds its own, echoing the client's EDNS), and
// it is not truncated (the caller truncates to the client's size). Its section slices
// belong to the caller, but the records in them are shared with the cache and must not
// be modified. source is SourceCache, SourceUpstream or SourceStale. err != nil means
// the caller answers SERVFAIL.
func (f *Forwarder) Forward(ctx context.Context, req *dns.Msg) (*dns.Msg, string, error) {
	if len(req.Question) != 1 {
		return nil, "", fmt.Errorf("forward: %d questions, want 1", len(req.Question))
	}
	q := req.Question[0]
	var flags uint8
	if opt := req.IsEdns0(); opt != nil && opt.Do() {
		flags |= flagDO
	}
	if req.CheckingDisabled {
		flags |= flagCD
	}
	h := hashKey(q.Name, q.Qtype, q.Qclass, flags)

	var stale *entry
	if f.cache != nil {
		if e := f.cache.get(h, q.Name, q.Qtype, q.Qclass, flags); e != nil {
			now := f.now()
			if ttl := e.remaining(now); ttl > 0 {
				f.hit(e, now)
				return render(e, req, ttl, flags), SourceCache, nil
			}
			if now < e.exp+f.stale {
				stale = e
			}
		}
	}
	f.m.misses.Inc()

	if stale != nil && !f.anyHealthy() {
		// Every upstream is known down: answer stale now and refresh in the background
		// (RFC 8767 section 5: do not make the client wait for a doomed attempt).
		f.refreshAsync(stale)
		f.m.hitStale.Inc()
		return render(stale, req, StaleAnswerTTL, flags), SourceStale, nil
	}

	e, err := f.resolve(ctx, cacheKey{name: lowerASCII(q.Name), qtype: q.Qtype, qclass: q.Qclass, flags: flags}, h, q.Name, req.Id)
	if stale != nil && (err != nil && !errors.Is(err, context.Canceled) || err == nil && e.hdr.Rcode == dns.RcodeServerFailure) {
		f.m.hitStale.Inc()
		return render(stale, req, StaleAnswerTTL, flags), SourceStale, nil
	}
	if err != nil {
		return nil, "", err
	}
	var ttl uint32
	if e.kind != kindUncached {
		ttl = e.ttl
	}
	return render(e, req, ttl, flags), SourceUpstream, nil
}

// CachedAnswer is a fresh cache hit in wire form, for a caller that writes the response
// packet itself (the resolver's UDP fast path). Records and the counts describe the
// answer, authority and additional sections (no OPT); the bytes are shared with the
// cache and must not be modified.
type CachedAnswer struct {
	Records                      []byte // packed without compression, every TTL set to the remaining lifetime
	Answer, Authority, Extra     uint16 // record counts
	Rcode                        uint8  // at most 15 (extended rcodes are not served here)
	Authoritative, AuthenticData bool   // AuthenticData: the AD bit as the upstream set it
}

// Cached answers a query from a fresh cache entry without building a message: the same
// hit as Forward would serve (same key, metrics and prefetch), as bytes. lname is the
// lower-cased question name; room is the most bytes the records may take. ok is false
// (and nothing is counted) when Forward must be used instead: no entry, an expired one
// (serve-stale and refresh belong to Forward), records larger than room (the caller
// truncates), or an entry that cannot be served this way.
func (f *Forwarder) Cached(lname string, qtype, qclass uint16, do, cd bool, room int) (a CachedAnswer, ok bool) {
	if f.cache == nil {
		return a, false
	}
	var flags uint8
	if do {
		flags |= flagDO
	}
	if cd {
		flags |= flagCD
	}
	e := f.cache.get(hashKey(lname, qtype, qclass, flags), lname, qtype, qclass, flags)
	if e == nil || e.hdr.Rcode > 0xF {
		return a, false
	}
	now := f.now()
	ttl := e.remaining(now)
	if ttl == 0 {
		return a, false
	}
	snap := e.snapshot(ttl)
	if snap.wire == nil || len(snap.wire) > room {
		return a, false
	}
	f.hit(e, now)
	return CachedAnswer{
		Records:       snap.wire,
		Answer:        uint16(e.na),
		Authority:     uint16(e.nns),
		Extra:         uint16(len(e.rrs) - e.na - e.nns),
		Rcode:         uint8(e.hdr.Rcode),
		Authoritative: e.hdr.Authoritative,
		AuthenticData: e.hdr.AuthenticatedData,
	}, true
}

// hit counts a fresh cache hit on e and starts a prefetch when it is due.
func (f *Forwarder) hit(e *entry, now int64) {
	if e.kind == kindDenial {
		f.m.hitDenial.Inc()
	} else {
		f.m.hitSuccess.Inc()
	}
	if f.cfg.Prefetch {
		f.maybePrefetch(e, now)
	}
}

// render builds the client's answer from e with every TTL set to ttl.
func render(e *entry, req *dns.Msg, ttl uint32, flags uint8) *dns.Msg {
	// One allocation per answer for the common case: the message, its question and
	// room for the record pointers of a small answer.
	type reply struct {
		msg dns.Msg
		q   [1]dns.Question
		rr  [4]dns.RR
	}
	r := new(reply)
	m := &r.msg
	m.Id = req.Id
	m.Response = true
	m.Opcode = req.Opcode
	m.Authoritative = e.hdr.Authoritative
	m.RecursionDesired = req.RecursionDesired
	m.RecursionAvailable = e.hdr.RecursionAvailable
	m.AuthenticatedData = e.hdr.AuthenticatedData && (flags&flagDO != 0 || req.AuthenticatedData)
	m.CheckingDisabled = req.CheckingDisabled
	m.Rcode = e.hdr.Rcode
	m.Compress = true
	r.q[0] = req.Question[0]
	m.Question = r.q[:]
	if rrs := e.records(ttl); len(rrs) > 0 {
		own := r.rr[:0:len(r.rr)]
		if len(rrs) > len(r.rr) {
			own = make([]dns.RR, 0, len(rrs))
		}
		own = append(own, rrs...)
		na, nns := e.na, e.na+e.nns
		if na > 0 {
			m.Answer = own[:na:na]
		}
		if nns > na {
			m.Ns = own[na:nns:nns]
		}
		if len(own) > nns {
			m.Extra = own[nns:]
		}
	}
	return m
}

// maybePrefetch refreshes e in the background once it is close to expiry (less than
// PrefetchPercent of its TTL left) and popular there (PrefetchMinHits hits in that
// window). Hits are only counted inside the window, so most hits touch no shared
// counter.
func (f *Forwarder) maybePrefetch(e *entry, now int64) {
	if (e.exp-now)*100 >= int64(e.ttl)*int64(time.Second)*PrefetchPercent {
		return
	}
	if e.hits.Add(1) < PrefetchMinHits {
		return
	}
	if f.refreshAsync(e) {
		f.m.prefetch.Inc()
	}
}

// refreshAsync starts one background upstream query for e's key unless one runs.
func (f *Forwarder) refreshAsync(e *entry) bool {
	if !e.fetch.CompareAndSwap(false, true) {
		return false
	}
	ok := f.goBackground(func() {
		ne, err := f.resolve(f.ctx, e.key, e.hash, e.key.name, 0)
		if err != nil || ne.kind == kindUncached {
			// Nothing replaced e: let a later hit try again.
			e.fetch.Store(false)
		}
	})
	if !ok {
		e.fetch.Store(false)
	}
	return ok
}

// goBackground runs fn in a goroutine that Close waits for, unless Close was called.
func (f *Forwarder) goBackground(fn func()) bool {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	if f.ctx.Err() != nil {
		return false
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		fn()
	}()
	return true
}

// resolve returns the upstream answer for key, sharing one upstream query among all
// concurrent callers with the same key. ctx only bounds this caller's wait.
func (f *Forwarder) resolve(ctx context.Context, key cacheKey, h uint64, qname string, clientID uint16) (*entry, error) {
	f.flightMu.Lock()
	fl, ok := f.flights[key]
	if !ok {
		if f.ctx.Err() != nil {
			f.flightMu.Unlock()
			return nil, ErrClosed
		}
		fl = &flight{done: make(chan struct{})}
		f.flights[key] = fl
		f.wg.Add(1) // under flightMu, checked f.ctx above: see goBackground
		go func() {
			defer f.wg.Done()
			fl.e, fl.err = f.fetch(key, h, qname, clientID)
			if fl.err == nil && fl.e.kind != kindUncached && f.cache != nil {
				f.cache.put(fl.e)
			}
			f.flightMu.Lock()
			delete(f.flights, key)
			f.flightMu.Unlock()
			close(fl.done)
		}()
	}
	f.flightMu.Unlock()
	select {
	case <-fl.done:
		return fl.e, fl.err
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for upstream answer: %w", ctx.Err())
	}
}

// fetch queries the upstreams for key within Timeout: healthy ones first in random
// order, then the unhealthy ones, for up to two rounds. SERVFAIL and REFUSED answers move
// on to the next upstream; if nothing better comes, the last of them is returned.
func (f *Forwarder) fetch(key cacheKey, h uint64, qname string, clientID uint16) (*entry, error) {
	if n := f.inflight.Add(1); f.cfg.MaxInFlight > 0 && n > int64(f.cfg.MaxInFlight) {
		f.inflight.Add(-1)
		f.m.overload.Inc()
		return nil, ErrOverloaded
	}
	defer f.inflight.Add(-1)
	ctx, cancel := context.WithTimeout(f.ctx, f.cfg.Timeout)
	defer cancel()

	q := new(dns.Msg)
	q.Opcode = dns.OpcodeQuery
	q.RecursionDesired = true
	q.CheckingDisabled = key.flags&flagCD != 0
	q.Question = []dns.Question{{Name: qname, Qtype: key.qtype, Qclass: key.qclass}}
	q.SetEdns0(EDNSBufferSize, key.flags&flagDO != 0)

	var (
		lastErr  error
		fallback *dns.Msg
	)
	order := f.order()
	for round := 0; round < 2; round++ {
		for _, s := range order {
			if ctx.Err() != nil {
				break
			}
			resp, err := f.exchange(ctx, s, q, clientID)
			if err != nil {
				if f.ctx.Err() != nil {
					return nil, ErrClosed
				}
				f.markFailed(s, err)
				lastErr = err
				continue
			}
			f.markHealthy(s)
			switch resp.Rcode {
			case dns.RcodeServerFailure:
				s.m.failures[reasonServfail].Inc()
				fallback = resp
				continue
			case dns.RcodeRefused, dns.RcodeNotImplemented, dns.RcodeFormatError:
				s.m.failures[reasonRcode].Inc()
				fallback = resp
				continue
			}
			return f.newEntry(key, h, resp), nil
		}
		if fallback != nil {
			break
		}
	}
	if fallback != nil {
		return f.newEntry(key, h, fallback), nil
	}
	if lastErr == nil {
		lastErr = ctx.Err()
	}
	return nil, fmt.Errorf("%w within %s: %w", ErrAllFailed, f.cfg.Timeout, lastErr)
}

// order returns the upstreams to try: healthy ones from a random start, then the rest.
func (f *Forwarder) order() []*server {
	n := len(f.servers)
	out := make([]*server, 0, n)
	start := rand.IntN(n)
	for i := range n {
		if s := f.servers[(start+i)%n]; s.healthy.Load() {
			out = append(out, s)
		}
	}
	for i := range n {
		if s := f.servers[(start+i)%n]; !s.healthy.Load() {
			out = append(out, s)
		}
	}
	return out
}

// newEntry classifies resp and computes its cache lifetime.
func (f *Forwarder) newEntry(key cacheKey, h uint64, resp *dns.Msg) *entry {
	e := &entry{key: key, hash: h, kind: kindUncached}
	e.hdr.Rcode = resp.Rcode
	e.hdr.Authoritative = resp.Authoritative
	e.hdr.RecursionAvailable = resp.RecursionAvailable
	e.hdr.AuthenticatedData = resp.AuthenticatedData
	e.rrs = make([]dns.RR, 0, len(resp.Answer)+len(resp.Ns)+len(resp.Extra))
	e.rrs = append(e.rrs, resp.Answer...)
	e.rrs = append(e.rrs, resp.Ns...)
	e.na, e.nns = len(resp.Answer), len(resp.Ns)
	for _, rr := range resp.Extra {
		if rr.Header().Rrtype != dns.TypeOPT {
			e.rrs = append(e.rrs, rr)
		}
	}
	if resp.Truncated {
		return e
	}

	var ttl time.Duration
	switch {
	case resp.Rcode == dns.RcodeSuccess && len(resp.Answer) > 0:
		minTTL := uint32(1<<32 - 1)
		for _, rr := range e.rrs {
			minTTL = min(minTTL, rr.Header().Ttl)
		}
		ttl = min(max(time.Duration(minTTL)*time.Second, f.cfg.MinTTL), f.cfg.MaxTTL)
		e.kind = kindSuccess
	case resp.Rcode == dns.RcodeSuccess || resp.Rcode == dns.RcodeNameError:
		// RFC 2308 section 5: the negative TTL is min(SOA TTL, SOA MINIMUM); without an
		// SOA the denial is not cached.
		var soa *dns.SOA
		for _, rr := range resp.Ns {
			if s, ok := rr.(*dns.SOA); ok {
				soa = s
				break
			}
		}
		if soa == nil {
			return e
		}
		ttl = min(max(time.Duration(min(soa.Hdr.Ttl, soa.Minttl))*time.Second, f.cfg.MinTTL), f.cfg.MaxNegTTL)
		e.kind = kindDenial
	default:
		return e
	}
	e.ttl = uint32(ttl / time.Second)
	e.exp = f.now() + int64(ttl)
	return e
}

func (f *Forwarder) anyHealthy() bool {
	for _, s := range f.servers {
		if s.healthy.Load() {
			return true
		}
	}
	return false
}

// markFailed records a failed attempt. Timeouts and socket errors take the upstream
// out of rotation at once; it is probed in the background until it answers.
func (f *Forwarder) markFailed(s *server, err error) {
	reason := reasonNetwork
	var ae *attemptError
	if errors.As(err, &ae) {
		reason = ae.reason
	}
	s.m.failures[reason].Inc()
	s.fails.Add(1)
	s.mu.Lock()
	s.lastErr = err.Error()
	down := s.healthy.CompareAndSwap(true, false)
	if down {
		s.since = time.Now()
	}
	s.mu.Unlock()
	if down {
		s.m.healthy.Set(0)
		f.log.Warn("upstream unhealthy, probing it in the background", "upstream", s.name, "reason", reason, "err", err)
		select {
		case f.wake <- struct{}{}:
		default:
		}
	}
}

func (f *Forwarder) markHealthy(s *server) {
	s.fails.Store(0)
	if s.healthy.Load() {
		return
	}
	s.mu.Lock()
	up := s.healthy.CompareAndSwap(false, true)
	if up {
		s.since = time.Now()
	}
	s.mu.Unlock()
	if up {
		s.m.healthy.Set(1)
		f.log.Info("upstream healthy again", "upstream", s.name)
	}
}

// healthLoop probes unhealthy upstreams every HealthInterval with ". IN NS"; any DNS
// answer (even SERVFAIL or REFUSED) brings the upstream back.
func (f *Forwarder) healthLoop(ctx context.Context) {
	t := time.NewTicker(f.cfg.HealthInterval)
	defer t.Stop()
	for {
		if f.anyUnhealthy() {
			select {
			case <-t.C:
			case <-ctx.Done():
				return
			case <-f.ctx.Done():
				return
			}
		} else {
			select {
			case <-f.wake:
				t.Reset(f.cfg.HealthInterval)
				continue
			case <-ctx.Done():
				return
			case <-f.ctx.Done():
				return
			}
		}
		var wg sync.WaitGroup
		for _, s := range f.servers {
			if s.healthy.Load() {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				f.probe(ctx, s)
			}()
		}
		wg.Wait()
	}
}

func (f *Forwarder) anyUnhealthy() bool {
	for _, s := range f.servers {
		if !s.healthy.Load() {
			return true
		}
	}
	return false
}

func (f *Forwarder) probe(ctx context.Context, s *server) {
	pctx, cancel := context.WithTimeout(ctx, f.cfg.AttemptTimeout)
	defer cancel()
	q := new(dns.Msg)
	q.SetQuestion(".", dns.TypeNS)
	q.SetEdns0(EDNSBufferSize, false)
	if _, err := f.exchange(pctx, s, q, 0); err != nil {
		if f.ctx.Err() == nil && ctx.Err() == nil {
			s.fails.Add(1)
			s.mu.Lock()
			s.lastErr = err.Error()
			s.mu.Unlock()
		}
		return
	}
	f.markHealthy(s)
}

// Collectors returns the metric collectors, for callers that register them elsewhere.
func (f *Forwarder) Collectors() []prometheus.Collector { return f.m.collectors }
