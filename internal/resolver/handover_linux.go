//go:build linux

package resolver

import (
	"fmt"
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
