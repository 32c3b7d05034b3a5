package upstream

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"syscall"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
)

// A resolution is one upstream resolution shared by every identical concurrent miss.
// It owns no goroutine: it moves on events, each handled under its mutex by whoever
// brings it: its start (in the goroutine of the miss that begins it, which sends the
// first query), a reply or a socket error (the socket's reader), its timer (a timer
// function), the end of a TCP retry, and Close. When an event ends it, that goroutine
// caches the answer and delivers it to the waiters.
//
// Each upstream gets one attempt (an ID on one of its sockets, sockets.go) for the
// whole resolution, and a reply to any query sent with it is accepted until the
// deadline: a retry never throws away the answer to the first query. Attempts go to
// the upstreams in turn (healthy ones first), each waiting that upstream's attempt
// timeout; the first useful reply from any of them wins. SERVFAIL, REFUSED, NOTIMP and
// FORMERR move on to the next upstream at once, and the last of them is returned if
// nothing better comes. An attempt after the first is sent only when the owner's
// budget allows it (SetRetryBudget); otherwise the resolution ends there.
type resolution struct {
	f        *Forwarder
	fl       *flight
	key      cacheKey
	h        uint64
	clientID uint16
	owner    uint64

	mu       sync.Mutex // guards everything below
	done     bool
	q        *dns.Msg
	began    int64 // monoNow at the start
	deadline time.Time
	order    []*server
	maxSends int
	attempts []*udpAttempt // at most one live attempt per upstream

	timer *time.Timer
	armed bool      // the timer is set for due
	due   time.Time // when the current wait ends
	cur   *udpAttempt
	wait  time.Duration
	tcp   bool // a TCP retry is running: no more sends until it ends

	lastErr  error
	fallback *dns.Msg
	fellBack netip.AddrPort // the server of fallback
	sends    int
	pending  int // attempts sent and neither answered nor failed
	next     int

	resp *dns.Msg // the outcome, once done
	from netip.AddrPort
	err  error
}

// start builds the query and sends the first attempt.
func (r *resolution) start() {
	r.event(func() bool {
		f := r.f
		q := new(dns.Msg)
		q.Opcode = dns.OpcodeQuery
		q.RecursionDesired = true
		q.CheckingDisabled = r.key.flags&flagCD != 0
		q.Question = []dns.Question{{Name: r.key.name, Qtype: r.key.qtype, Qclass: r.key.qclass}}
		q.SetEdns0(EDNSBufferSize, r.key.flags&flagDO != 0)
		r.q = q
		r.order = f.order()
		r.maxSends = max(3, 2*len(r.order))
		r.attempts = make([]*udpAttempt, 0, len(r.order))
		r.began, r.deadline = monoNow(), time.Now().Add(f.cfg.Timeout)
		return r.advance()
	})
}

// replied takes a validated reply to attempt a.
func (r *resolution) replied(a *udpAttempt, resp *dns.Msg, at time.Time) {
	r.event(func() bool {
		if a.released {
			return false
		}
		r.disarm()
		f, s := r.f, a.s
		if a.sends == 1 {
			s.sample(at.Sub(a.firstSend), f.cfg.MinAttemptTimeout, f.cfg.Timeout)
		}
		s.m.duration.Observe(at.Sub(a.firstSend).Seconds())
		f.markHealthy(s)
		if resp.Truncated {
			if !r.tcp { // one TCP retry at a time; a second truncated reply waits for it
				r.retryTCP(a)
			}
			return false
		}
		return r.judge(a, resp)
	})
}

// failedAttempt takes a socket error for attempt a.
func (r *resolution) failedAttempt(a *udpAttempt, err error) {
	r.event(func() bool {
		if a.released || a.dead {
			return false
		}
		r.disarm()
		r.settle(a)
		r.f.markAttemptFailed(a.s, err, r.began)
		r.lastErr = err
		return r.advance()
	})
}

// timedOut is the timer's function: the current attempt had no answer in time (or
// the deadline passed).
func (r *resolution) timedOut() {
	r.event(func() bool {
		if !r.armed || time.Now().Before(r.due) {
			return false // a stale firing: the timer was stopped or set again since
		}
		r.armed = false
		if cur := r.cur; cur != nil {
			s := cur.s
			s.backoff(r.f.cfg.Timeout)
			r.lastErr = failed(reasonTimeout, fmt.Errorf("no answer from %s within %s", s.addrStr, r.wait.Round(time.Millisecond)))
			r.f.markAttemptFailed(s, r.lastErr, r.began)
		}
		return r.moveOn()
	})
}

// abort ends the resolution with err (Close).
func (r *resolution) abort(err error) {
	r.event(func() bool {
		r.resp, r.err = nil, err
		return true
	})
}

// event runs step under the mutex unless the resolution is done; when step ends it,
// the answer is cached and delivered. A panic anywhere in it ends the resolution
// with ErrPanic for its waiters.
func (r *resolution) event(step func() (ended bool)) {
	if r.locked(step) {
		r.complete()
	}
}

func (r *resolution) locked(step func() bool) (ended bool) {
	defer func() {
		if v := recover(); v != nil {
			err := r.panicked(v)
			r.mu.Lock()
			ended = !r.done
			r.done = true
			r.resp, r.err = nil, err
			r.mu.Unlock()
		}
	}()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return false
	}
	if !step() {
		return false
	}
	r.done = true
	return true
}

// advance sends the next attempt and sets the timer for it, or ends the resolution
// (true) when there is nothing left to send or wait for.
func (r *resolution) advance() bool {
	for {
		if r.tcp {
			return false // the TCP retry's end moves the resolution on
		}
		now := time.Now()
		if !now.Before(r.deadline) {
			return r.conclude()
		}
		wait := r.deadline.Sub(now)
		var cur *udpAttempt
		if r.sends < r.maxSends {
			if r.sends > 0 && !r.f.retryAllowed(r.owner) {
				r.lastErr = errRetryBudget
				return r.conclude()
			}
			if cur = r.sendNext(); cur == nil {
				continue
			}
			wait = min(wait, cur.s.attemptTimeout())
		} else if r.pending == 0 {
			return r.conclude() // nothing sent is still out and no more attempts: give up early
		}
		r.arm(cur, wait)
		return false
	}
}

// moveOn ends the resolution when every upstream had its say, else advances it.
func (r *resolution) moveOn() bool {
	if r.fallback != nil && r.pending == 0 && r.sends >= len(r.order) {
		return r.conclude()
	}
	return r.advance()
}

// arm sets the timer to wait for cur's answer (or, cur nil, for the deadline).
func (r *resolution) arm(cur *udpAttempt, wait time.Duration) {
	r.cur, r.wait = cur, wait
	r.armed, r.due = true, time.Now().Add(wait)
	if r.timer == nil {
		r.timer = time.AfterFunc(wait, r.timedOut)
		return
	}
	r.timer.Reset(wait)
}

func (r *resolution) disarm() {
	if r.armed {
		r.armed = false
		r.timer.Stop()
	}
}

// sendNext sends the next attempt, to the next upstream in turn (a new attempt when
// that upstream has none, or a dead one). It returns the attempt, or nil when it
// could not be sent.
func (r *resolution) sendNext() *udpAttempt {
	f := r.f
	s := r.order[r.next%len(r.order)]
	r.next++
	r.sends++
	a := r.attemptFor(s)
	if a == nil {
		var err error
		if a, err = s.sockets.register(r, r.q, r.clientID); err != nil {
			f.markFailed(s, err)
			r.lastErr = err
			return nil
		}
		r.attempts = append(r.attempts, a)
	}
	if err := a.send(); err != nil {
		f.markFailed(s, err)
		r.lastErr = err
		a.dead = true
		if errors.Is(err, syscall.ECONNREFUSED) {
			// The error was queued by an earlier datagram on this socket, to the same
			// port: the other attempts waiting on it fail too.
			f.wg.Add(1) // this resolution holds the group open: Close is not done waiting
			go func() {
				defer f.wg.Done()
				s.sockets.failAll(a.sock, err)
			}()
		}
		return nil
	}
	if a.sends == 1 {
		r.pending++
	}
	return a
}

// attemptFor returns the live attempt to s, or nil. A dead one (failed or answered
// uselessly: nothing more to read for it) is released and forgotten, so that the
// next send to s gets a new attempt.
func (r *resolution) attemptFor(s *server) *udpAttempt {
	for i, a := range r.attempts {
		if a.s != s {
			continue
		}
		if a.dead {
			s.sockets.release(a)
			r.attempts = append(r.attempts[:i], r.attempts[i+1:]...)
			return nil
		}
		return a
	}
	return nil
}

// settle marks attempt a as done: nothing more is expected from it.
func (r *resolution) settle(a *udpAttempt) {
	if !a.dead {
		a.dead = true
		r.pending--
	}
}

// judge takes a's (complete) answer: a useful one ends the resolution; SERVFAIL,
// REFUSED, NOTIMP and FORMERR are kept as the fallback and the resolution moves on.
func (r *resolution) judge(a *udpAttempt, resp *dns.Msg) bool {
	s := a.s
	switch resp.Rcode {
	case dns.RcodeServerFailure:
		s.m.failures[reasonServfail].Inc()
	case dns.RcodeRefused, dns.RcodeNotImplemented, dns.RcodeFormatError:
		s.m.failures[reasonRcode].Inc()
	default:
		r.resp, r.from, r.err = resp, s.addr, nil
		return true
	}
	r.fallback, r.fellBack = resp, s.addr
	r.settle(a)
	return r.moveOn()
}

// retryTCP asks a's upstream again over TCP after a truncated UDP answer, in a
// goroutine of its own; the resolution sends nothing more meanwhile.
func (r *resolution) retryTCP(a *udpAttempt) {
	r.tcp = true
	f := r.f
	f.wg.Add(1) // this resolution holds the group open: Close is not done waiting
	go func() {
		defer f.wg.Done()
		resp, err := f.exchangeTCP(a.s, r.q, a.id, r.deadline)
		r.event(func() bool {
			r.tcp = false
			if err != nil {
				r.lastErr = err
				f.markFailed(a.s, err)
				r.settle(a)
				return r.advance()
			}
			return r.judge(a, resp)
		})
	}()
}

// conclude ends the resolution with the fallback answer, or the last error.
func (r *resolution) conclude() bool {
	if r.fallback != nil {
		r.resp, r.from, r.err = r.fallback, r.fellBack, nil
		return true
	}
	if r.lastErr == nil {
		r.lastErr = errors.New("no attempt could be sent")
	}
	r.resp, r.err = nil, fmt.Errorf("%w within %s: %w", ErrAllFailed, r.f.cfg.Timeout, r.lastErr)
	return true
}

// complete runs once the resolution is done: it releases the attempts, caches the
// answer and delivers it to every waiter.
func (r *resolution) complete() {
	f := r.f
	if r.timer != nil {
		r.timer.Stop()
	}
	for _, a := range r.attempts {
		a.s.sockets.release(a)
	}
	e, err := r.entry()
	f.inflight.Add(-1)
	f.flightMu.Lock()
	delete(f.flights, r.key)
	ws := r.fl.waiters
	r.fl.waiters = nil
	f.flightMu.Unlock()
	for _, w := range ws {
		f.deliver(w, e, err)
	}
	f.wg.Done()
}

// entry turns the outcome into a cache entry, cached when cacheable and charged to
// the owner.
func (r *resolution) entry() (e *entry, err error) {
	if r.err != nil {
		return nil, r.err
	}
	defer func() {
		if v := recover(); v != nil {
			e, err = nil, r.panicked(v)
		}
	}()
	f := r.f
	if e, err = f.newEntry(r.key, r.h, r.resp); err != nil {
		return nil, err
	}
	e.server, e.owner = r.from, r.owner
	if e.kind != kindUncached && f.cache != nil {
		f.cache.put(e)
	}
	return e, nil
}

// panicked counts a panic recovered in the resolution and returns the error its
// waiters get.
func (r *resolution) panicked(v any) error {
	r.f.cfg.Panics.Recovered(panicguard.StageUpstream, v, "qname", r.key.name, "qtype", r.key.qtype)
	return fmt.Errorf("%w: %v", ErrPanic, v)
}
