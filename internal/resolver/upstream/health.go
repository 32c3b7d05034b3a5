package upstream

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// ServerHealth is the state of one upstream, for `status`.
type ServerHealth struct {
	Server              netip.AddrPort
	Healthy             bool
	ConsecutiveFailures uint32
	LastError           string        // last failure, empty if none yet
	Since               time.Time     // last change of Healthy (zero: healthy since start)
	SmoothedRTT         time.Duration // 0 until the first clean sample
	AttemptTimeout      time.Duration // what the next attempt waits
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
			SmoothedRTT:         s.srtt,
			AttemptTimeout:      s.rto,
		})
		s.mu.Unlock()
	}
	return out
}

func (f *Forwarder) anyHealthy() bool {
	for _, s := range f.servers {
		if s.healthy.Load() {
			return true
		}
	}
	return false
}

func (f *Forwarder) anyUnhealthy() bool {
	for _, s := range f.servers {
		if !s.healthy.Load() {
			return true
		}
	}
	return false
}

// markFailed records a failed attempt (a timeout or a socket error). MaxFails of them
// in a row take the upstream out of rotation; it is then probed in the background until
// it answers. One lost reply therefore never marks an upstream down.
func (f *Forwarder) markFailed(s *server, err error) {
	reason := reasonNetwork
	var ae *attemptError
	if errors.As(err, &ae) {
		reason = ae.reason
	}
	s.m.failures[reason].Inc()
	n := s.fails.Add(1)
	s.mu.Lock()
	s.lastErr = err.Error()
	down := n >= uint32(f.cfg.MaxFails) && s.healthy.CompareAndSwap(true, false)
	if down {
		s.since = time.Now()
	}
	s.mu.Unlock()
	if down {
		s.m.transitions.Inc()
		s.m.healthy.Set(0)
		f.logTransition(s, slog.LevelWarn, "upstream unhealthy, probing it in the background",
			"consecutive_failures", n, "reason", reason, "err", err)
		select {
		case f.wake <- struct{}{}:
		default:
		}
	}
}

// markAttemptFailed records a failed attempt of a resolution begun at began (monoNow).
// A timeout is an outage only when the upstream has replied to nothing at all since
// the resolution began and for at least SilenceForDown (or never did): otherwise it is alive
// and dropped this query (rate limiting, loss, or replies still queued on a busy
// machine). A drop is counted as reason="dropped" and never takes the upstream out of
// rotation. Anything else is a failure (markFailed).
func (f *Forwarder) markAttemptFailed(s *server, err error, began int64) {
	var ae *attemptError
	isTimeout := errors.As(err, &ae) && ae.reason == reasonTimeout || netReason(err) == reasonTimeout
	if last := s.lastReply.Load(); isTimeout && last != 0 && (last >= began || monoNow()-last < int64(SilenceForDown)) {
		s.m.failures[reasonDropped].Inc()
		return
	}
	f.markFailed(s, err)
}

// markHealthy records a reply from s (any DNS message that matches the query).
func (f *Forwarder) markHealthy(s *server) {
	s.lastReply.Store(monoNow())
	if s.fails.Load() != 0 {
		s.fails.Store(0)
	}
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
		s.m.transitions.Inc()
		s.m.healthy.Set(1)
		f.logTransition(s, slog.LevelInfo, "upstream healthy again")
	}
}

// transitionLogEvery is the least time between two logged health changes of one
// upstream; the changes in between are counted (meshdns_upstream_health_transitions_total)
// and summed up in the next line.
const transitionLogEvery = 10 * time.Second

// logTransition logs a change of s's health, unless one was logged less than
// transitionLogEvery ago.
func (f *Forwarder) logTransition(s *server, level slog.Level, msg string, args ...any) {
	s.mu.Lock()
	now := time.Now()
	if !s.lastLog.IsZero() && now.Sub(s.lastLog) < transitionLogEvery {
		s.unlogged++
		s.mu.Unlock()
		return
	}
	s.lastLog = now
	skipped := s.unlogged
	s.unlogged = 0
	s.mu.Unlock()
	args = append([]any{"upstream", s.name}, args...)
	if skipped > 0 {
		args = append(args, "unlogged_transitions", skipped)
	}
	f.log.Log(context.Background(), level, msg, args...)
}

// healthLoop probes unhealthy upstreams every HealthInterval with ". IN NS"; any DNS
// answer (even SERVFAIL or REFUSED) brings the upstream back. It runs until Close.
func (f *Forwarder) healthLoop() {
	t := time.NewTicker(f.cfg.HealthInterval)
	defer t.Stop()
	for {
		if f.anyUnhealthy() {
			select {
			case <-t.C:
			case <-f.ctx.Done():
				return
			}
		} else {
			select {
			case <-f.wake:
				t.Reset(f.cfg.HealthInterval)
				continue
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
				f.probe(s)
			}()
		}
		wg.Wait()
	}
}

// probe sends one health query to s and waits up to its attempt timeout.
func (f *Forwarder) probe(s *server) {
	q := new(dns.Msg)
	q.SetQuestion(".", dns.TypeNS)
	q.SetEdns0(EDNSBufferSize, false)
	wait := max(s.attemptTimeout(), f.cfg.AttemptTimeout)
	replies := make(chan reply, 4)
	a, err := f.dialUDP(s, q, 0, time.Now().Add(wait), replies)
	if err != nil {
		f.probeFailed(s, err)
		return
	}
	defer a.close()
	if err := a.send(); err != nil {
		f.probeFailed(s, err)
		return
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case r := <-replies:
		if r.err != nil {
			f.probeFailed(s, r.err)
			return
		}
		f.markHealthy(s)
	case <-t.C:
		f.probeFailed(s, failed(reasonTimeout, errors.New("health probe timed out")))
	case <-f.ctx.Done():
	}
}

func (f *Forwarder) probeFailed(s *server, err error) {
	if f.ctx.Err() != nil {
		return
	}
	s.fails.Add(1)
	s.mu.Lock()
	s.lastErr = err.Error()
	s.mu.Unlock()
}
