//go:build !linux

package resolver

import (
	"fmt"
	"net"
	"os"
)

// udpSockFile returns a duplicate of u's socket.
func udpSockFile(u *udpSock) (*os.File, error) { return u.c.File() }

// udpSockFromFile serves a duplicate of f's bound UDP socket (the caller
// closes f) and returns its port.
func udpSockFromFile(f *os.File) (*udpSock, int, error) {
	pc, err := net.FilePacketConn(f)
	if err != nil {
		return nil, 0, err
	}
	c, ok := pc.(*net.UDPConn)
	if !ok {
		pc.Close()
		return nil, 0, fmt.Errorf("%T is not a UDP socket", pc)
	}
	return &udpSock{c: c}, c.LocalAddr().(*net.UDPAddr).Port, nil
}

// queued reports whether a query waits in a listening socket's queue; outside
// Linux it cannot tell, and a drain relies on its quiet period alone.
func (s *Server) queued() bool { return false }
