package resolver

// Listener handover and drain: the resolver side of an agent upgrade or restart
// with zero lost queries (docs/design.md, "Upgrades, restarts and crashes").
//
// The contract (keep it when the server changes):
//   - Config.Inherited: pre-bound sockets from a predecessor process. An address of
//     Config.Listen that has an entry is served on those sockets instead of being
//     bound; the files are the server's to close (Start closes the ones no listen
//     address takes).
//   - Config.OnDequeue(n): called with the number of datagrams (empty ones too) or
//     connections a read took off a listening socket, on every read, before
//     anything else: the datapath's liveness signal. It must be cheap (an atomic
//     add on shared memory). Empty datagrams are liveness probes: counted, never
//     answered, not counted as dropped.
//   - Files(): duplicates of every listening socket, by listen address, for a
//     successor (and for registering them with the datapath).
//   - Drain(ctx, quiet): serve until no query was read or waited in a socket's
//     queue for quiet (0: stop at once; a queue is checked too because readers a
//     busy machine kept from running may not have read it yet), then stop reading
//     new queries while every one already read is answered, in-flight forwards and
//     queries queued on open TCP connections included, then close this process's
//     file descriptors. It works when the sockets stay open in a successor: it
//     neither shuts them down nor relies on their closing (the UDP readers notice
//     the stop within their receive timeout).
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

// drainIdle is how long a TCP connection may stay idle once a drain began.
const drainIdle = 100 * time.Millisecond

// dequeued records that a read took n datagrams or connections off a socket.
func (s *Server) dequeued(n int) {
	s.progress.Add(uint64(n))
	if s.onDequeue != nil {
		s.onDequeue(n)
	}
}

// tcpIdle is how long a TCP connection may wait for its next query.
func (s *Server) tcpIdle() time.Duration {
	if s.stopping.Load() {
		return drainIdle
	}
	return tcpIdleTimeout
}

// drained is called when a connection's read ends: during a drain it waits
// until every query read on it is answered (forwards included) or the
// connection is closed (the drain gave up: Drain's ctx).
func (tc *tcpConn) drained() {
	for tc.s.stopping.Load() && tc.busy.Load() > 0 {
		if tc.c.SetReadDeadline(time.Now().Add(drainIdle)) != nil {
			return // closed
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// adopt serves la on inherited sockets, if there are any for it.
func (s *Server) adopt(la listenAddr) (bool, error) {
	in, ok := s.inherited[la.raw]
	if !ok {
		return false, nil
	}
	delete(s.inherited, la.raw)
	var udp []*udpSock
	fail := func(err error) (bool, error) {
		for _, u := range udp {
			u.close()
		}
		for _, f := range in.UDP {
			f.Close()
		}
		if in.TCP != nil {
			in.TCP.Close()
		}
		return true, fmt.Errorf("resolver: inherited sockets of %s: %w", la.raw, err)
	}
	if len(in.UDP) == 0 || in.TCP == nil {
		return fail(errors.New("need UDP sockets and a TCP listener"))
	}
	port := -1
	for _, f := range in.UDP {
		u, p, err := udpSockFromFile(f)
		if err != nil {
			return fail(err)
		}
		udp = append(udp, u)
		if port >= 0 && p != port {
			return fail(fmt.Errorf("UDP sockets bound to ports %d and %d", port, p))
		}
		port = p
	}
	if la.port != 0 && port != la.port {
		return fail(fmt.Errorf("UDP sockets bound to port %d", port))
	}
	tl, err := net.FileListener(in.TCP)
	if err != nil {
		return fail(err)
	}
	for _, f := range in.UDP {
		f.Close()
	}
	in.TCP.Close()
	host := la.host
	if host == "" {
		host = udp[0].localIP()
	}
	s.mu.Lock()
	s.udp = append(s.udp, udp...)
	s.tcp = append(s.tcp, tl)
	s.addrs = append(s.addrs, net.JoinHostPort(host, fmt.Sprint(port)))
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
	if len(s.tcp) == 0 || len(s.tcp) != len(s.addrs) || len(s.udp)%len(s.tcp) != 0 {
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
		for _, u := range s.udp[i*per : (i+1)*per] {
			f, err := udpSockFile(u)
			if err != nil {
				return fail(err)
			}
			in.UDP = append(in.UDP, f)
		}
		out = append(out, in)
		tl, ok := l.(*net.TCPListener)
		if !ok {
			return fail(fmt.Errorf("%T is not a TCP listener", l))
		}
		f, err := tl.File()
		if err != nil {
			return fail(err)
		}
		out[len(out)-1].TCP = f
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

// Drain serves until nothing was read and nothing waited in a socket's queue
// for quiet since it began (0: not at all), then stops reading new queries, answers every
// query already read (in-flight forwards and queries queued on open TCP
// connections included), and closes this process's file descriptors of the
// sockets. It returns when everything is answered or ctx is done (then the rest
// is cut off). It replaces Shutdown; Close after it does nothing.
func (s *Server) Drain(ctx context.Context, quiet time.Duration) error {
	if quiet > 0 {
		// Quiet means nothing read for quiet since the drain began, too: queries
		// sent just before it began may still be on their way.
		t := time.NewTicker(quiet / 4)
		last, seen := time.Now(), s.progress.Load()
	wait:
		for time.Since(last) < quiet {
			select {
			case <-ctx.Done():
				break wait
			case <-t.C:
			}
			if n := s.progress.Load(); n != seen || s.queued() {
				last, seen = time.Now(), n
			}
		}
		t.Stop()
	}
	s.closed.Do(func() {
		s.stopping.Store(true)
		s.mu.Lock()
		for _, l := range s.tcp {
			l.Close() // this process's descriptor only: a successor's stays listening
		}
		deadline := time.Now().Add(drainIdle)
		for c := range s.conns {
			_ = c.c.SetReadDeadline(deadline) // read what is queued, then end
		}
		s.mu.Unlock()
		s.readers.Wait()
		done := make(chan struct{})
		go func() {
			s.wg.Wait() // connections: every query read is answered
			s.pending.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-ctx.Done():
			s.closeErr = fmt.Errorf("resolver drain: %d queries still waiting for the upstream: %w", s.limits.total.Load(), ctx.Err())
		}
		s.closeSockets()
		s.wg.Wait()
	})
	return s.closeErr
}
