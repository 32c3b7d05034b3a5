// Package upstream forwards the queries the resolver does not answer from its name table
// to the upstream nameservers, with a cache in front.
//
// The cache (cache.go) is positive and negative (RFC 2308), bounded in entries and bytes
// and sharded, keyed on the lower-cased name, type, class and the DO and CD bits; its
// entries keep their records packed (answer.go), so a hit is bytes the caller appends to
// its response. It serves stale answers (RFC 8767) when every upstream fails, refreshes
// popular entries before they expire, and coalesces identical concurrent misses into
// one upstream resolution, whose waiters are callbacks rather than goroutines.
//
// A resolution (resolution.go) tries the upstreams in turn with per-upstream attempt
// timeouts from measured round-trip times (pool.go), accepts a late reply to any earlier
// attempt within the total budget, and retries over TCP when a UDP answer is truncated.
// It owns no goroutine: events move it. Its queries go out on each upstream's shared
// sockets (sockets.go): connected, with SO_MARK, a random query ID and a source port
// that changes every few dozen queries, advertising an EDNS buffer of 1232 bytes
// (exchange.go); replies that do not match a waiting query are dropped. Health
// (health.go) takes an upstream out of rotation after MaxFails consecutive failures and
// probes it until it answers again.
package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

var (
	// ErrOverloaded is returned when MaxInFlight upstream resolutions are already running.
	ErrOverloaded = errors.New("too many upstream queries in flight")
	// ErrAllFailed is returned when no upstream answered within the deadline.
	ErrAllFailed = errors.New("all upstreams failed")
	// ErrClosed is returned after Close.
	ErrClosed = errors.New("forwarder closed")
	// ErrPanic is returned to the waiters of a resolution that panicked (recovered
	// and counted in Config.Panics).
	ErrPanic = errors.New("upstream resolution panicked")
)

// Forwarder answers queries from its cache or its upstreams. It is safe for concurrent
// use. Its lifecycle: New (validate), Start (acquire, run health checks), Close.
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

	retry atomic.Pointer[func(owner uint64) bool] // SetRetryBudget; nil: every retry is sent

	started   atomic.Bool
	closeOnce sync.Once
}

// Waiter receives the outcome of ForwardAsync. err != nil means the caller answers
// SERVFAIL.
type Waiter func(a Answer, err error)

// flight is one upstream resolution shared by every identical concurrent miss.
type flight struct {
	r       *resolution
	waiters []waiter // under flightMu until the flight is done
}

type waiter struct {
	done  Waiter
	stale *entry // an expired entry to fall back to when the resolution fails
}

// New validates cfg, applies defaults and registers the metrics. It opens no socket;
// Start does.
func New(cfg Config) (*Forwarder, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("upstream config: %w", err)
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
		f.cache = newCache(cfg.CacheSize, cfg.CacheBytes, cfg.workloadBytes(), max(cfg.StaleTTL, 0))
	}
	for _, a := range cfg.Servers {
		s := &server{addr: a, addrStr: a.String(), name: a.String(), rto: cfg.AttemptTimeout}
		s.sockets = newSocketPool(f, s)
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

// Start checks that upstream sockets can carry the mark (a missing privilege is reported
// here, not on the first query) and starts the background health checks, which run
// until Close. ctx bounds only the start.
func (f *Forwarder) Start(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if f.ctx.Err() != nil {
		return ErrClosed
	}
	if !f.started.CompareAndSwap(false, true) {
		return errors.New("upstream forwarder already started")
	}
	if err := checkMark(f.cfg.Mark); err != nil {
		return err
	}
	f.goBackground(f.healthLoop)
	return nil
}

// Close stops the background work, fails the waiting queries with ErrClosed, and
// unregisters the metrics. It is idempotent.
func (f *Forwarder) Close() error {
	f.closeOnce.Do(func() {
		f.flightMu.Lock() // no goBackground or new resolution after this
		f.cancel()
		running := make([]*resolution, 0, len(f.flights))
		for _, fl := range f.flights {
			running = append(running, fl.r)
		}
		f.flightMu.Unlock()
		for _, r := range running {
			r.abort(ErrClosed)
		}
		for _, s := range f.servers {
			s.sockets.close()
		}
		f.wg.Wait()
		if f.cfg.Registerer != nil {
			for _, c := range f.m.collectors {
				f.cfg.Registerer.Unregister(c)
			}
		}
	})
	return nil
}

// errRetryBudget ends a resolution whose next attempt its workload's budget did not allow.
var errRetryBudget = errors.New("no retry: the workload's upstream budget is spent")

// SetRetryBudget makes every attempt of a resolution after its first (a retry after
// a timeout, the next upstream after a SERVFAIL) ask allow whether the workload the
// miss is charged to (Query.Owner, when not 0) may send one more upstream query:
// the resolver takes a token of that workload's budget. When allow says no, the
// attempt is not sent and the resolution ends as on its last timeout (a stale
// answer, a SERVFAIL answer kept from another upstream, else ErrAllFailed). nil
// sends every retry.
func (f *Forwarder) SetRetryBudget(allow func(owner uint64) bool) {
	if allow == nil {
		f.retry.Store(nil)
		return
	}
	f.retry.Store(&allow)
}

// retryAllowed reports whether owner may send one more attempt.
func (f *Forwarder) retryAllowed(owner uint64) bool {
	allow := f.retry.Load()
	if allow == nil || owner == 0 || (*allow)(owner) {
		return true
	}
	f.m.retryOverBudget.Inc()
	return false
}

// Cached answers q from a fresh cache entry, or reports false (counting nothing) when
// the query must be forwarded: no entry, or an expired one (serve-stale and refresh
// belong to Forward). It never blocks and allocates at most once per entry and second.
func (f *Forwarder) Cached(q *Query) (Answer, bool) {
	if f.cache == nil {
		return Answer{}, false
	}
	flags := q.flags()
	e := f.cache.get(hashKey(q.Name, q.Qtype, q.Qclass, flags), q.Name, q.Qtype, q.Qclass, flags)
	if e == nil {
		return Answer{}, false
	}
	now := f.now()
	ttl := e.remaining(now)
	if ttl == 0 {
		return Answer{}, false
	}
	f.hit(e, now)
	return e.answer(ttl, SourceCache), true
}

// Forward answers q from the cache or the upstreams and waits for the answer until ctx
// ends. err != nil means the caller answers SERVFAIL.
func (f *Forwarder) Forward(ctx context.Context, q *Query) (Answer, error) {
	type result struct {
		a   Answer
		err error
	}
	ch := make(chan result, 1)
	f.ForwardAsync(q, func(a Answer, err error) { ch <- result{a, err} })
	select {
	case r := <-ch:
		return r.a, r.err
	case <-ctx.Done():
		return Answer{}, fmt.Errorf("wait for upstream answer: %w", ctx.Err())
	}
}

// ForwardAsync answers q from the cache or the upstreams and calls done exactly once
// with the outcome: at once (in the caller's goroutine) for a cache hit, a stale answer
// or an immediate failure (every upstream's send failing included), otherwise from the
// goroutine that ends the upstream resolution (an upstream socket's reader, a timer),
// which identical concurrent misses share. A waiting query costs its callback, not a
// goroutine. done must not block.
func (f *Forwarder) ForwardAsync(q *Query, done Waiter) {
	flags := q.flags()
	h := hashKey(q.Name, q.Qtype, q.Qclass, flags)
	var stale *entry
	if f.cache != nil {
		if e := f.cache.get(h, q.Name, q.Qtype, q.Qclass, flags); e != nil {
			now := f.now()
			if ttl := e.remaining(now); ttl > 0 {
				f.hit(e, now)
				done(e.answer(ttl, SourceCache), nil)
				return
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
		done(stale.answer(StaleAnswerTTL, SourceStale), nil)
		return
	}
	key := cacheKey{name: lowerASCII(q.Name), qtype: q.Qtype, qclass: q.Qclass, flags: flags}
	if err := f.resolve(key, h, q.ClientID, q.Owner, waiter{done: done, stale: stale}); err != nil {
		if stale != nil && !errors.Is(err, ErrClosed) {
			f.m.hitStale.Inc()
			done(stale.answer(StaleAnswerTTL, SourceStale), nil)
			return
		}
		done(Answer{}, err)
	}
}

// deliver hands the outcome of a resolution to one waiter.
func (f *Forwarder) deliver(w waiter, e *entry, err error) {
	if w.done == nil {
		return
	}
	if w.stale != nil && (err != nil && !errors.Is(err, ErrClosed) || err == nil && e.rcode == dns.RcodeServerFailure) {
		f.m.hitStale.Inc()
		w.done(w.stale.answer(StaleAnswerTTL, SourceStale), nil)
		return
	}
	if err != nil {
		w.done(Answer{}, err)
		return
	}
	ttl := uint32(0)
	if e.kind != kindUncached {
		ttl = e.ttl
	}
	w.done(e.answer(ttl, SourceUpstream), nil)
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

// refreshAsync starts one background upstream resolution for e's key unless one runs.
func (f *Forwarder) refreshAsync(e *entry) bool {
	if !e.fetch.CompareAndSwap(false, true) {
		return false
	}
	err := f.resolve(e.key, e.hash, 0, e.owner, waiter{done: func(a Answer, err error) {
		if err != nil || a.Source != SourceUpstream {
			e.fetch.Store(false) // nothing replaced e: let a later hit try again
		}
	}})
	if err != nil {
		e.fetch.Store(false)
		return false
	}
	return true
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

// resolve adds w to the upstream resolution of key, starting one unless it runs. It
// returns an error (and does not call w) when no resolution can be started. The
// answer a resolution caches is charged to owner, the workload whose miss started it.
// A resolution started here sends its first query before resolve returns.
func (f *Forwarder) resolve(key cacheKey, h uint64, clientID uint16, owner uint64, w waiter) error {
	r, err := f.join(key, h, clientID, owner, w)
	if r != nil {
		r.start()
	}
	return err
}

// join adds w to the flight of key, or starts a flight and returns its resolution,
// which the caller starts.
func (f *Forwarder) join(key cacheKey, h uint64, clientID uint16, owner uint64, w waiter) (*resolution, error) {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	if fl := f.flights[key]; fl != nil {
		fl.waiters = append(fl.waiters, w)
		return nil, nil
	}
	if f.ctx.Err() != nil {
		return nil, ErrClosed
	}
	if n := f.inflight.Add(1); f.cfg.MaxInFlight > 0 && n > int64(f.cfg.MaxInFlight) {
		f.inflight.Add(-1)
		f.m.overload.Inc()
		return nil, ErrOverloaded
	}
	fl := &flight{waiters: []waiter{w}}
	fl.r = &resolution{f: f, fl: fl, key: key, h: h, clientID: clientID, owner: owner}
	f.flights[key] = fl
	f.wg.Add(1) // under flightMu, checked f.ctx above: see goBackground; Done in complete
	return fl.r, nil
}

// newEntry classifies resp, computes its cache lifetime and packs its records.
func (f *Forwarder) newEntry(key cacheKey, h uint64, resp *dns.Msg) (*entry, error) {
	e := &entry{key: key, hash: h, kind: kindUncached}
	e.rcode = resp.Rcode
	e.aa, e.ra, e.ad = resp.Authoritative, resp.RecursionAvailable, resp.AuthenticatedData
	rrs := make([]dns.RR, 0, len(resp.Answer)+len(resp.Ns)+len(resp.Extra))
	rrs = append(rrs, resp.Answer...)
	rrs = append(rrs, resp.Ns...)
	for _, rr := range resp.Extra {
		if rr.Header().Rrtype != dns.TypeOPT {
			rrs = append(rrs, rr)
		}
	}
	e.na, e.nns = uint16(len(resp.Answer)), uint16(len(resp.Ns))
	e.nex = uint16(len(rrs) - len(resp.Answer) - len(resp.Ns))
	var err error
	if e.wire, e.ttlOff, err = packRecords(rrs); err != nil {
		return nil, fmt.Errorf("upstream answer: %w", err)
	}

	var ttl time.Duration
	switch {
	case resp.Truncated:
		return e, nil
	case resp.Rcode == dns.RcodeSuccess && len(resp.Answer) > 0:
		minTTL := uint32(1<<32 - 1)
		for _, rr := range rrs {
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
			return e, nil
		}
		ttl = min(max(time.Duration(min(soa.Hdr.Ttl, soa.Minttl))*time.Second, f.cfg.MinTTL), f.cfg.MaxNegTTL)
		e.kind = kindDenial
	default:
		return e, nil
	}
	e.ttl = uint32(ttl / time.Second)
	e.exp = f.now() + int64(ttl)
	return e, nil
}
