package resolver

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// The TCP transport: one goroutine per connection reads queries (RFC 7766 pipelining)
// and runs each through the query path; table and cache answers are written at once,
// forwarded ones when they arrive, so answers may come back out of order. Connections
// are bounded (Config.MaxTCPConns): at the bound the connection idle the longest is
// closed for the new one, or the new one is refused when none is idle. A connection
// holds a small read buffer sized to its largest query; response buffers are pooled.

// tcpConn is one client connection.
type tcpConn struct {
	s        *Server
	c        net.Conn
	wmu      sync.Mutex
	busy     atomic.Int32 // queries read and not yet answered
	lastUsed atomic.Int64 // unix nanoseconds of the last query or answer
}

func (s *Server) serveTCP(l net.Listener) {
	defer s.readers.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			s.log.Debug("tcp accept", "err", err)
			time.Sleep(5 * time.Millisecond) // e.g. EMFILE: do not spin
			continue
		}
		s.dequeued(1)
		tc := &tcpConn{s: s, c: c}
		tc.lastUsed.Store(time.Now().UnixNano())
		if !s.admit(tc) {
			c.Close()
			continue
		}
		s.wg.Add(1)
		go tc.serve()
	}
}

// admit registers tc, closing the connection idle the longest when at the bound. It
// reports false when tc must be refused (stopping, or every connection is busy).
func (s *Server) admit(tc *tcpConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping.Load() {
		return false
	}
	if len(s.conns) >= s.maxConns {
		var oldest *tcpConn
		for c := range s.conns {
			if c.busy.Load() == 0 && (oldest == nil || c.lastUsed.Load() < oldest.lastUsed.Load()) {
				oldest = c
			}
		}
		if oldest == nil {
			s.m.tcpRefused.Inc()
			return false
		}
		delete(s.conns, oldest)
		oldest.c.Close()
		s.m.tcpEvicted.Inc()
	}
	s.conns[tc] = struct{}{}
	return true
}

func (tc *tcpConn) serve() {
	s := tc.s
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, tc)
		s.mu.Unlock()
		tc.c.Close()
	}()
	c := &client{proto: protoTCP}
	if ap, err := netip.ParseAddrPort(tc.c.RemoteAddr().String()); err == nil {
		c.setSender(s, ap) // once: a connection has one sender
	}
	c.reply.tcp = tc
	w := newWorker(s)
	in := make([]byte, 512)
	var hdr [2]byte
	for {
		_ = tc.c.SetReadDeadline(time.Now().Add(s.tcpIdle()))
		if _, err := io.ReadFull(tc.c, hdr[:]); err != nil {
			tc.drained()
			return
		}
		n := int(binary.BigEndian.Uint16(hdr[:]))
		if n > len(in) {
			in = make([]byte, n)
		}
		if _, err := io.ReadFull(tc.c, in[:n]); err != nil {
			return
		}
		start := time.Now()
		tc.lastUsed.Store(start.UnixNano())
		tc.busy.Add(1)
		bp := s.outBufs.get(dns.MaxMsgSize)
		b := w.serve(in[:n], *bp, c, start)
		if b != nil {
			tc.write(b)
		} else if !w.req.pending {
			tc.busy.Add(-1) // dropped
		}
		s.outBufs.put(bp)
		if n < 12 {
			return // no ID to answer to (serve dropped it): the stream is unusable
		}
	}
}

// write sends one length-prefixed answer (from the reading goroutine or from a
// forwarded answer's callback).
func (tc *tcpConn) write(b []byte) {
	defer tc.busy.Add(-1)
	tc.lastUsed.Store(time.Now().UnixNano())
	var l [2]byte
	binary.BigEndian.PutUint16(l[:], uint16(len(b)))
	bufs := net.Buffers{l[:], b}
	tc.wmu.Lock()
	defer tc.wmu.Unlock()
	_ = tc.c.SetWriteDeadline(time.Now().Add(tcpWriteTimeout))
	if _, err := bufs.WriteTo(tc.c); err != nil {
		tc.c.Close()
	}
}
