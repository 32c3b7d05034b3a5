package upstream

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// server is one upstream: its address, measured round-trip time and health.
type server struct {
	addr    netip.AddrPort
	addrStr string
	name    string // metric label
	m       *serverMetrics
	sockets *socketPool

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
