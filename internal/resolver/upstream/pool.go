package upstream

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// server is one upstream: its address, measured round-trip time and health.
type server struct {
	addr    netip.AddrPort
	addrStr string
	name    string // metric label
	m       *serverMetrics

	healthy   atomic.Bool
	fails     atomic.Uint32 // consecutive failed attempts
	lastReply atomic.Int64  // monoNow of the last reply to anything, 0 = none yet
	mu        sync.Mutex    // guards the fields below
	lastErr   string
	since     time.Time
	lastLog   time.Time     // of the last logged health change
	unlogged  int           // health changes since then, not logged
	srtt      time.Duration // smoothed RTT, 0 = no sample yet
	rttvar    time.Duration
	rto       time.Duration // current attempt timeout (backed off after timeouts)
}

// monoBase anchors monoNow: nanoseconds on the monotonic clock, never 0 after start.
var monoBase = time.Now().Add(-time.Nanosecond)

func monoNow() int64 { return int64(time.Since(monoBase)) }

// attemptTimeout returns how long to wait for this upstream's answer to one attempt.
func (s *server) attemptTimeout() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rto
}

// sample folds a clean round-trip measurement (an answer to a query sent once) into the
// RTT estimate, as RFC 6298 does for TCP, and resets the backed-off timeout.
func (s *server) sample(rtt time.Duration, minRTO, maxRTO time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srtt == 0 {
		s.srtt, s.rttvar = rtt, rtt/2
	} else {
		d := s.srtt - rtt
		if d < 0 {
			d = -d
		}
		s.rttvar = (3*s.rttvar + d) / 4
		s.srtt = (7*s.srtt + rtt) / 8
	}
	s.rto = min(max(s.srtt+4*s.rttvar, minRTO), maxRTO)
}

// backoff doubles the attempt timeout after a timeout (until the next clean sample).
func (s *server) backoff(maxRTO time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rto = min(2*s.rto, maxRTO)
}

// order returns the upstreams to try: healthy ones from a random start, then the rest.
// Each server's health is read once (another query may flip it meanwhile), so every
// server is in the list exactly once.
func (f *Forwarder) order() []*server {
	n := len(f.servers)
	out := make([]*server, n)
	start := rand.IntN(n)
	head, tail := 0, n
	for i := range n {
		s := f.servers[(start+i)%n]
		if s.healthy.Load() {
			out[head] = s
			head++
		} else {
			tail--
			out[tail] = s
		}
	}
	// The unhealthy ones were filled in from the end: put them back in turn order.
	slices.Reverse(out[head:])
	return out
}

// reply is what an attempt's socket reader delivers: a validated reply or a socket error.
type reply struct {
	a    *udpAttempt
	resp *dns.Msg
	err  error
	at   time.Time
}

// fetch resolves q (whose question is set) against the upstreams within Timeout.
//
// Each upstream gets one connected UDP socket (a random source port and query ID) for
// the whole resolution, and a reply to any query sent on it is accepted until the
// deadline: a retry never throws away the answer to the first query. Attempts go to
// the upstreams in turn (healthy ones first), each waiting that upstream's attempt
// timeout; the first useful reply from any of them wins. SERVFAIL, REFUSED, NOTIMP and
// FORMERR move on to the next upstream at once, and the last of them is returned if
// nothing better comes. An attempt after the first is sent only when owner's budget
// allows it (SetRetryBudget); otherwise the resolution ends there.
func (f *Forwarder) fetch(q *dns.Msg, clientID uint16, owner uint64) (*dns.Msg, netip.AddrPort, error) {
	r := f.newResolution(q, clientID)
	defer r.close()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := time.Now()
		if !now.Before(r.deadline) {
			break
		}
		wait := r.deadline.Sub(now)
		var cur *udpAttempt
		if r.sends < r.maxSends {
			if r.sends > 0 && !f.retryAllowed(owner) {
				r.lastErr = errRetryBudget
				break
			}
			if cur = r.sendNext(); cur == nil {
				continue
			}
			wait = min(wait, cur.s.attemptTimeout())
		} else if r.pending == 0 {
			break // nothing sent is still out and no more attempts: give up early
		}
		timer.Reset(wait)
		select {
		case rep := <-r.replies:
			if !timer.Stop() {
				<-timer.C
			}
			answer, from, settled := r.received(rep)
			if answer != nil {
				return answer, from, nil
			}
			if !settled {
				continue
			}
		case <-timer.C:
			if cur != nil {
				r.timedOut(cur, wait)
			}
		case <-f.ctx.Done():
			return nil, netip.AddrPort{}, ErrClosed
		}
		if r.fallback != nil && r.pending == 0 && r.sends >= len(r.order) {
			break // every upstream had its say
		}
	}
	return r.result()
}

// resolution is one fetch in progress: an attempt (a connected UDP socket)
// per upstream, and what came back so far.
type resolution struct {
	f        *Forwarder
	q        *dns.Msg
	clientID uint16
	began    int64 // monoNow at the start
	deadline time.Time
	order    []*server
	maxSends int
	replies  chan reply
	attempts map[*server]*udpAttempt

	lastErr  error
	fallback *dns.Msg
	fellBack netip.AddrPort // the server of fallback
	sends    int
	pending  int // attempts sent and neither answered nor failed
	next     int
}

func (f *Forwarder) newResolution(q *dns.Msg, clientID uint16) resolution {
	order := f.order()
	maxSends := max(3, 2*len(order))
	return resolution{
		f: f, q: q, clientID: clientID, began: monoNow(), deadline: time.Now().Add(f.cfg.Timeout),
		order: order, maxSends: maxSends, replies: make(chan reply, 2*maxSends),
		attempts: make(map[*server]*udpAttempt, len(order)),
	}
}

func (r *resolution) close() {
	for _, a := range r.attempts {
		a.close()
	}
}

// sendNext sends the next attempt, to the next upstream in turn, on its
// socket (a new one when it has none, or a dead one). It returns the attempt,
// or nil when it could not be sent.
func (r *resolution) sendNext() *udpAttempt {
	f := r.f
	s := r.order[r.next%len(r.order)]
	r.next++
	r.sends++
	a := r.attempts[s]
	if a == nil || a.dead {
		if a != nil {
			a.close() // failed or answered uselessly: nothing more to read from it
		}
		var err error
		if a, err = f.dialUDP(s, r.q, r.clientID, r.deadline, r.replies); err != nil {
			f.markFailed(s, err)
			r.lastErr = err
			return nil
		}
		r.attempts[s] = a
	}
	if err := a.send(); err != nil {
		f.markFailed(s, err)
		r.lastErr = err
		a.dead = true
		return nil
	}
	if a.sends == 1 {
		r.pending++
	}
	return a
}

// settle marks attempt a as done: nothing more is expected from it.
func (r *resolution) settle(a *udpAttempt) {
	if !a.dead {
		a.dead = true
		r.pending--
	}
}

// received takes a reply (or an attempt's failure). It returns the answer
// when it is useful; otherwise settled reports that the reply was a DNS
// answer kept as the fallback (SERVFAIL, REFUSED, NOTIMP, FORMERR), not a
// failure.
func (r *resolution) received(rep reply) (answer *dns.Msg, from netip.AddrPort, settled bool) {
	f, s := r.f, rep.a.s
	if rep.err != nil {
		r.settle(rep.a)
		f.markAttemptFailed(s, rep.err, r.began)
		r.lastErr = rep.err
		return nil, netip.AddrPort{}, false
	}
	if rep.a.sends == 1 {
		s.sample(rep.at.Sub(rep.a.firstSend), f.cfg.MinAttemptTimeout, f.cfg.Timeout)
	}
	s.m.duration.Observe(rep.at.Sub(rep.a.firstSend).Seconds())
	f.markHealthy(s)
	resp := rep.resp
	if resp.Truncated {
		if resp, r.lastErr = f.exchangeTCP(s, r.q, rep.a.id, r.deadline); r.lastErr != nil {
			f.markFailed(s, r.lastErr)
			r.settle(rep.a)
			return nil, netip.AddrPort{}, false
		}
	}
	switch resp.Rcode {
	case dns.RcodeServerFailure:
		s.m.failures[reasonServfail].Inc()
	case dns.RcodeRefused, dns.RcodeNotImplemented, dns.RcodeFormatError:
		s.m.failures[reasonRcode].Inc()
	default:
		return resp, s.addr, true
	}
	r.fallback, r.fellBack = resp, s.addr
	r.settle(rep.a)
	return nil, netip.AddrPort{}, true
}

// timedOut records that attempt cur had no answer within wait.
func (r *resolution) timedOut(cur *udpAttempt, wait time.Duration) {
	s := cur.s
	s.backoff(r.f.cfg.Timeout)
	r.lastErr = failed(reasonTimeout, fmt.Errorf("no answer from %s within %s", s.addrStr, wait.Round(time.Millisecond)))
	r.f.markAttemptFailed(s, r.lastErr, r.began)
}

// result is the fallback answer, or the last error.
func (r *resolution) result() (*dns.Msg, netip.AddrPort, error) {
	if r.fallback != nil {
		return r.fallback, r.fellBack, nil
	}
	if r.lastErr == nil {
		r.lastErr = errors.New("no attempt could be sent")
	}
	return nil, netip.AddrPort{}, fmt.Errorf("%w within %s: %w", ErrAllFailed, r.f.cfg.Timeout, r.lastErr)
}
