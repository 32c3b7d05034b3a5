package agent

import (
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"
)

// Liveness (/healthz, `meshdns-ebpf probe live`): the resolver is wedged when
// a query waits for it and it reads nothing for livenessStall. A busy or
// CPU-starved resolver still reads now and then; an idle one has nothing
// waiting. To know that something waits without looking into its sockets'
// queues, the monitor makes sure something does: once nothing was read for
// livenessProbeAfter it sends the resolver an empty datagram (which the
// resolver reads and counts, and does not answer), and a resolver that has
// not read anything by livenessStall after that is wedged.
const (
	livenessProbeAfter = time.Second
	livenessStall      = 5 * time.Second
	// livenessInterval is how often the monitor looks.
	livenessInterval = 500 * time.Millisecond
)

// liveness watches the resolver's progress (its reads).
type liveness struct {
	progress func() uint64
	probe    func() error

	mu       sync.Mutex
	count    uint64    // progress at the last look
	moved    time.Time // when the last look saw progress (or the first look)
	probedAt time.Time // when the pending probe was sent; zero: none pending
	probedN  uint64    // progress then
}

func newLiveness(progress func() uint64, probe func() error, now time.Time) *liveness {
	return &liveness{progress: progress, probe: probe, count: progress(), moved: now}
}

// look notes progress, and sends a probe when nothing was read for
// livenessProbeAfter and none is pending. A probe that cannot be sent is
// retried at the next look.
func (l *liveness) look(now time.Time) {
	n := l.progress()
	l.mu.Lock()
	defer l.mu.Unlock()
	if n != l.count {
		l.count, l.moved, l.probedAt = n, now, time.Time{}
		return
	}
	if l.probedAt.IsZero() && now.Sub(l.moved) >= livenessProbeAfter && l.probe() == nil {
		l.probedAt, l.probedN = now, n
	}
}

// check returns why the resolver is wedged, or nil: a probe has waited
// livenessStall with nothing read since it was sent.
func (l *liveness) check(now time.Time) error {
	n := l.progress()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.probedAt.IsZero() || n != l.probedN {
		return nil
	}
	if waited := now.Sub(l.probedAt); waited >= livenessStall {
		return fmt.Errorf("the resolver is wedged: it has read nothing for %v while a query waited for it", now.Sub(l.moved).Round(time.Second))
	}
	return nil
}

// resolverProbe returns a function that sends the resolver at addr (a
// listen address; an unspecified one is reached on loopback) an empty
// datagram, over a socket opened now and closed by the returned close.
func resolverProbe(addr string) (send func() error, close func() error, err error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, nil, fmt.Errorf("liveness probe address %q: %w", addr, err)
	}
	if ap.Addr().IsUnspecified() {
		lo := netip.IPv6Loopback()
		if ap.Addr().Is4() {
			lo = netip.AddrFrom4([4]byte{127, 0, 0, 1})
		}
		ap = netip.AddrPortFrom(lo, ap.Port())
	}
	network := "udp4"
	if ap.Addr().Is6() {
		network = "udp6"
	}
	c, err := net.ListenUDP(network, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("liveness probe socket: %w", err)
	}
	dst := net.UDPAddrFromAddrPort(ap)
	return func() error { _, err := c.WriteToUDP(nil, dst); return err }, c.Close, nil
}
