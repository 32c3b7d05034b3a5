//go:build linux

package resolver

import (
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// udpSockFile returns a duplicate of u's socket.
func udpSockFile(u *udpSock) (*os.File, error) {
	u.mu.RLock()
	defer u.mu.RUnlock()
	if u.closed {
		return nil, os.ErrClosed
	}
	fd, err := unix.FcntlInt(uintptr(u.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup: %w", err)
	}
	return os.NewFile(uintptr(fd), "udp"), nil
}

// udpSockFromFile serves a duplicate of f's bound UDP socket (the caller
// closes f) the way bindUDP sets one up, and returns its port.
func udpSockFromFile(f *os.File) (*udpSock, int, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return nil, 0, err
	}
	fd := -1
	var dupErr error
	if err := raw.Control(func(s uintptr) { fd, dupErr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, 0, err
	}
	if dupErr != nil {
		return nil, 0, fmt.Errorf("dup: %w", dupErr)
	}
	fail := func(what string, err error) (*udpSock, int, error) {
		unix.Close(fd)
		return nil, 0, fmt.Errorf("%s: %w", what, err)
	}
	if typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || typ != unix.SOCK_DGRAM {
		return fail("not a UDP socket", err)
	}
	// The readers block in the kernel (shared with the predecessor's file
	// description: it is blocking there too) with the receive timeout.
	if err := unix.SetNonblock(fd, false); err != nil {
		return fail("blocking mode", err)
	}
	tv := unix.NsecToTimeval(int64(udpRcvTimeout))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fail("SO_RCVTIMEO", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return fail("getsockname", err)
	}
	u := &udpSock{fd: fd}
	var port int
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		u.v4, port = true, a.Port
		u.pktinfo = a.Addr == [4]byte{}
	case *unix.SockaddrInet6:
		port = a.Port
		u.pktinfo = a.Addr == [16]byte{}
	default:
		return fail("socket family", fmt.Errorf("%T", sa))
	}
	return u, port, nil
}

// queued reports whether a query waits in a listening socket's queue: a
// datagram in a UDP socket's receive queue (FIONREAD: the size of the next
// one; an empty probe does not count) or a connection in a TCP listener's
// accept queue (TCP_INFO's unacked, for a listener). A drain does not end while
// one does, however long the readers have not run.
func (s *Server) queued() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, u := range s.udp {
		u.mu.RLock()
		n := 0
		if !u.closed {
			n, _ = unix.IoctlGetInt(u.fd, unix.SIOCINQ)
		}
		u.mu.RUnlock()
		if n > 0 {
			return true
		}
	}
	for _, l := range s.tcp {
		tl, ok := l.(*net.TCPListener)
		if !ok {
			continue
		}
		rc, err := tl.SyscallConn()
		if err != nil {
			continue
		}
		var backlog uint32
		_ = rc.Control(func(fd uintptr) {
			if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
				backlog = info.Unacked
			}
		})
		if backlog > 0 {
			return true
		}
	}
	return false
}
