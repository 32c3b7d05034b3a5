package upstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
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

// probe sends one health query to s, on a socket of its own, and waits up to its
// attempt timeout for the answer.
func (f *Forwarder) probe(s *server) {
	q := new(dns.Msg)
	q.SetQuestion(".", dns.TypeNS)
	q.SetEdns0(EDNSBufferSize, false)
	q.Id = randomID(0)
	wait := max(s.attemptTimeout(), f.cfg.AttemptTimeout)
	if err := f.exchangeProbe(s, q, time.Now().Add(wait)); err != nil {
		f.probeFailed(s, err)
		return
	}
	f.markHealthy(s)
}

// exchangeProbe sends q to s and reads until a reply matches it or the deadline.
// Close ends it at once (the socket is closed).
func (f *Forwarder) exchangeProbe(s *server, q *dns.Msg, deadline time.Time) error {
	wire, err := q.Pack()
	if err != nil {
		return fmt.Errorf("pack health probe: %w", err)
	}
	conn, err := f.dialer.DialContext(f.ctx, "udp", s.addrStr)
	if err != nil {
		return failed(netReason(err), fmt.Errorf("dial udp %s: %w", s.addrStr, err))
	}
	defer conn.Close()
	stop := context.AfterFunc(f.ctx, func() { conn.Close() })
	defer stop()
	_ = conn.SetDeadline(deadline)
	s.m.reqUDP.Inc()
	if _, err := conn.Write(wire); err != nil {
		return failed(netReason(err), fmt.Errorf("send health probe to %s: %w", s.addrStr, err))
	}
	bp := udpBufPool.Get().(*[]byte)
	defer udpBufPool.Put(bp)
	for {
		n, err := conn.Read(*bp)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return failed(reasonTimeout, errors.New("health probe timed out"))
			}
			return failed(netReason(err), fmt.Errorf("health probe to %s: %w", s.addrStr, err))
		}
		if _, err := parseReply((*bp)[:n], q); err == nil {
			return nil // the caller marks s healthy
		}
		s.m.failures[reasonMismatch].Inc()
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
