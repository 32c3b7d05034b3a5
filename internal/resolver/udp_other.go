//go:build !linux

package resolver

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"time"
)

// Outside Linux the UDP transport is portable and simple: one socket per address,
// read by one goroutine through Go's netpoller, no SO_REUSEPORT, no batching and no
// packet info (a wildcard address replies from the system's choice of source). It
// exists so the package builds and runs everywhere; the agent runs on Linux.

const reusePortSupported = false

type udpSock struct{ c *net.UDPConn }

func (u *udpSock) close() { u.c.Close() }

func (u *udpSock) localIP() string {
	return u.c.LocalAddr().(*net.UDPAddr).IP.String()
}

func bindUDP(host string, port int) (*udpSock, int, error) {
	addr := &net.UDPAddr{Port: port}
	if host != "" {
		addr.IP = net.ParseIP(host)
	}
	c, err := net.ListenUDP("udp", addr)
	if err != nil {
		return nil, 0, err
	}
	return &udpSock{c: c}, c.LocalAddr().(*net.UDPAddr).Port, nil
}

func listenTCP(addr string) (net.Listener, error) {
	var lc net.ListenConfig
	return lc.Listen(context.Background(), "tcp", addr)
}

// udpReply is where a later UDP answer goes.
type udpReply struct {
	sock *udpSock
	to   netip.AddrPort
}

func (r *udpReply) send(b []byte) {
	if r.sock != nil {
		_, _ = r.sock.c.WriteToUDPAddrPort(b, r.to)
	}
}

func (s *Server) readUDP(u *udpSock) {
	defer s.readers.Done()
	w := newWorker(s)
	in := make([]byte, 4096)
	out := make([]byte, maxUDPResponse)
	c := &client{proto: protoUDP}
	for !s.stopping.Load() {
		_ = u.c.SetReadDeadline(time.Now().Add(250 * time.Millisecond))
		n, from, err := u.c.ReadFromUDPAddrPort(in)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		s.dequeued(1)
		if n == 0 {
			continue // a liveness probe (handover.go): counted, not answered
		}
		*c = client{proto: protoUDP}
		c.setSender(s, from)
		c.reply.sock, c.reply.to = u, from
		if b := w.serve(in[:n], out, c, time.Now()); b != nil {
			c.reply.send(b)
		}
	}
}
