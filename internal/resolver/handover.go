package resolver

// Listener handover and drain: the resolver side of an agent upgrade or restart
// with zero lost queries (docs/design.md, "Upgrades, restarts and crashes").
//
// The contract (the resolver rewrite must keep it):
//   - Config.Inherited: pre-bound sockets from a predecessor process. An address of
//     Config.Listen that has an entry is served on those sockets instead of being
//     bound; the files are the server's to close.
//   - Config.OnDequeue(n): called with the number of datagrams (empty ones too) or
//     connections a read took off a listening socket, on every read, before
//     anything else: the datapath's liveness signal. It must be cheap (an atomic
//     add on shared memory). Empty datagrams are liveness probes: counted, never
//     answered, not counted as malformed.
//   - Files(): duplicates of every listening socket, by listen address, for a
//     successor (and for registering them with the datapath).
//   - Drain(ctx, quiet): serve until no query was read for quiet (0: stop at once),
//     then stop reading new queries while every one already read is answered,
//     in-flight forwards included (the request context is not cancelled), close
//     idle TCP connections, and close this process's file descriptors. It works
//     when the sockets stay open in a successor: it neither shuts them down nor
//     relies on their closing.
//   - TCP listeners are plain TCP (not MPTCP): the datapath registers them in a
//     SOCKMAP, which does not take MPTCP sockets.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
)

// InheritedListener is one listen address's pre-bound sockets.
type InheritedListener struct {
	Addr string     // as in Config.Listen: "ip:port"
	UDP  []*os.File // bound UDP sockets of the address (one SO_REUSEPORT group)
	TCP  *os.File   // its listening TCP socket
}

// drainIdle is how long a TCP connection may stay idle once a drain started.
const drainIdle = 100 * time.Millisecond

// dequeued records that a read took n messages or connections off a socket.
func (s *Server) dequeued(n int) {
	s.lastRead.Store(time.Now().UnixNano())
	if s.onDequeue != nil {
		s.onDequeue(n)
	}
}

// adopt serves la on inherited sockets, if there are any for it.
func (s *Server) adopt(la listenAddr) (bool, error) {
	in, ok := s.inherited[la.raw]
	if !ok {
		return false, nil
	}
	delete(s.inherited, la.raw)
	var udp []*net.UDPConn
	fail := func(err error) (bool, error) {
		for _, c := range udp {
			c.Close()
		}
		return true, fmt.Errorf("resolver: inherited sockets of %s: %w", la.raw, err)
	}
	if len(in.UDP) == 0 || in.TCP == nil {
		return fail(errors.New("need UDP sockets and a TCP listener"))
	}
	for _, f := range in.UDP {
		pc, err := net.FilePacketConn(f)
		f.Close()
		if err != nil {
			return fail(err)
		}
		uc, ok := pc.(*net.UDPConn)
		if !ok {
			pc.Close()
			return fail(fmt.Errorf("%T is not a UDP socket", pc))
		}
		udp = append(udp, uc)
	}
	tl, err := net.FileListener(in.TCP)
	in.TCP.Close()
	if err != nil {
		return fail(err)
	}
	bound := udp[0].LocalAddr().(*net.UDPAddr)
	s.mu.Lock()
	s.udp = append(s.udp, udp...)
	s.tcp = append(s.tcp, tl)
	s.addrs = append(s.addrs, bound.String())
	s.mu.Unlock()
	return true, nil
}

// closeInherited closes inherited files no listen address took.
func (s *Server) closeInherited() {
	for _, in := range s.inherited {
		for _, f := range in.UDP {
			f.Close()
		}
		if in.TCP != nil {
			in.TCP.Close()
		}
	}
	s.inherited = nil
}

// Files returns duplicates of every listening socket, by listen address, in
// Config.Listen order. The caller closes them.
func (s *Server) Files() ([]InheritedListener, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.tcp) != len(s.addrs) || len(s.udp) == 0 {
		return nil, errors.New("resolver: not listening")
	}
	per := len(s.udp) / len(s.tcp)
	out := make([]InheritedListener, 0, len(s.tcp))
	fail := func(err error) ([]InheritedListener, error) {
		for _, in := range out {
			for _, f := range in.UDP {
				f.Close()
			}
			if in.TCP != nil {
				in.TCP.Close()
			}
		}
		return nil, fmt.Errorf("resolver: duplicate listening sockets: %w", err)
	}
	for i, l := range s.tcp {
		in := InheritedListener{Addr: s.listenRaw(i)}
		for _, c := range s.udp[i*per : (i+1)*per] {
			f, err := c.File()
			if err != nil {
				return fail(err)
			}
			in.UDP = append(in.UDP, f)
		}
		tl, ok := l.(*net.TCPListener)
		if !ok {
			return fail(fmt.Errorf("%T is not a TCP listener", l))
		}
		f, err := tl.File()
		if err != nil {
			return fail(err)
		}
		in.TCP = f
		out = append(out, in)
	}
	return out, nil
}

// listenRaw is the Config.Listen entry of the i-th bound address (the bound
// address itself when the entry asked for port 0).
func (s *Server) listenRaw(i int) string {
	if i < len(s.listen) && s.listen[i].port != 0 {
		return s.listen[i].raw
	}
	return s.addrs[i]
}

// Drain serves until nothing was read for quiet since it began or since the
// last read (0: not at all), then stops
// reading new queries, answers every query already read (in-flight forwards
// included) and closes idle TCP connections, then closes this process's file
// descriptors of the sockets. It returns when everything is answered or ctx is
// done (then the rest is cut off: the request context is cancelled).
func (s *Server) Drain(ctx context.Context, quiet time.Duration) error {
	if quiet > 0 {
		// Quiet means nothing read for quiet since the drain began, too: queries
		// sent just before it began may still be on their way.
		began := time.Now()
		last := func() time.Time {
			if t := time.Unix(0, s.lastRead.Load()); t.After(began) {
				return t
			}
			return began
		}
		t := time.NewTicker(quiet / 4)
	wait:
		for time.Since(last()) < quiet {
			select {
			case <-ctx.Done():
				break wait
			case <-t.C:
			}
		}
		t.Stop()
	}
	s.draining.Store(true)
	now := time.Now()
	s.mu.Lock()
	for _, c := range s.udp {
		_ = c.SetReadDeadline(now) // readers return at once and stop
	}
	for _, l := range s.tcp {
		if tl, ok := l.(*net.TCPListener); ok {
			_ = tl.SetDeadline(now)
		}
	}
	for c := range s.conns {
		_ = c.SetReadDeadline(now.Add(drainIdle)) // answer what is queued, then close
	}
	s.mu.Unlock()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		err = fmt.Errorf("resolver drain: %w", ctx.Err())
	}
	s.stopping.Store(true)
	s.closeAll()
	s.cancel()
	return err
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
