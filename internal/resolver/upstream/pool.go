package upstream

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
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

	healthy atomic.Bool
	fails   atomic.Uint32 // consecutive failed attempts
	mu      sync.Mutex    // guards the fields below
	lastErr string
	since   time.Time
	srtt    time.Duration // smoothed RTT, 0 = no sample yet
	rttvar  time.Duration
	rto     time.Duration // current attempt timeout (backed off after timeouts)
}

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
// nothing better comes.
func (f *Forwarder) fetch(q *dns.Msg, clientID uint16) (*dns.Msg, netip.AddrPort, error) {
	start := time.Now()
	deadline := start.Add(f.cfg.Timeout)
	order := f.order()
	maxSends := max(3, 2*len(order))
	replies := make(chan reply, 2*maxSends)
	attempts := make(map[*server]*udpAttempt, len(order))
	defer func() {
		for _, a := range attempts {
			a.close()
		}
	}()
	var (
		lastErr  error
		fallback *dns.Msg
		fellBack netip.AddrPort // the server of fallback
		sends    int
		pending  int // attempts sent and neither answered nor failed
		next     int
		timer    = time.NewTimer(time.Hour)
	)
	defer timer.Stop()
	for {
		now := time.Now()
		if !now.Before(deadline) {
			break
		}
		wait := deadline.Sub(now)
		var cur *udpAttempt
		if sends < maxSends {
			s := order[next%len(order)]
			next++
			a := attempts[s]
			if a == nil || a.dead {
				if a != nil {
					a.close() // failed or answered uselessly: nothing more to read from it
				}
				var err error
				a, err = f.dialUDP(s, q, clientID, deadline, replies)
				if err != nil {
					f.markFailed(s, err)
					lastErr = err
					sends++
					continue
				}
				attempts[s] = a
			}
			if err := a.send(); err != nil {
				f.markFailed(s, err)
				lastErr = err
				a.dead = true
				sends++
				continue
			}
			sends++
			if a.sends == 1 {
				pending++
			}
			cur = a
			wait = min(wait, s.attemptTimeout())
		} else if pending == 0 {
			break // nothing sent is still out and no more attempts: give up early
		}
		timer.Reset(wait)
		select {
		case r := <-replies:
			if !timer.Stop() {
				<-timer.C
			}
			s := r.a.s
			if r.err != nil {
				if !r.a.dead {
					r.a.dead = true
					pending--
				}
				f.markFailed(s, r.err)
				lastErr = r.err
				continue
			}
			if r.a.sends == 1 {
				s.sample(r.at.Sub(r.a.firstSend), f.cfg.MinAttemptTimeout, f.cfg.Timeout)
			}
			s.m.duration.Observe(r.at.Sub(r.a.firstSend).Seconds())
			f.markHealthy(s)
			resp := r.resp
			if resp.Truncated {
				resp, lastErr = f.exchangeTCP(s, q, r.a.id, deadline)
				if lastErr != nil {
					f.markFailed(s, lastErr)
					if !r.a.dead {
						r.a.dead = true
						pending--
					}
					continue
				}
			}
			switch resp.Rcode {
			case dns.RcodeServerFailure:
				s.m.failures[reasonServfail].Inc()
			case dns.RcodeRefused, dns.RcodeNotImplemented, dns.RcodeFormatError:
				s.m.failures[reasonRcode].Inc()
			default:
				return resp, s.addr, nil
			}
			fallback, fellBack = resp, s.addr
			if !r.a.dead {
				r.a.dead = true
				pending--
			}
		case <-timer.C:
			if cur != nil {
				s := cur.s
				s.backoff(f.cfg.Timeout)
				lastErr = failed(reasonTimeout, fmt.Errorf("no answer from %s within %s", s.addrStr, wait.Round(time.Millisecond)))
				f.markFailed(s, lastErr)
			}
		case <-f.ctx.Done():
			return nil, netip.AddrPort{}, ErrClosed
		}
		if fallback != nil && pending == 0 && sends >= len(order) {
			break // every upstream had its say
		}
	}
	if fallback != nil {
		return fallback, fellBack, nil
	}
	if lastErr == nil {
		lastErr = errors.New("no attempt could be sent")
	}
	return nil, netip.AddrPort{}, fmt.Errorf("%w within %s: %w", ErrAllFailed, f.cfg.Timeout, lastErr)
}
