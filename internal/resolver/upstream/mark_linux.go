//go:build linux

package upstream

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// testHookControl, when set by tests, is called with each upstream socket after the
// mark was set.
var testHookControl func(fd uintptr)

// control returns the net.Dialer Control function that marks every upstream socket.
func control(mark uint32) func(network, address string, c syscall.RawConn) error {
	return func(network, address string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			serr = markFD(int(fd), mark, network, address)
		})
		if err != nil {
			return fmt.Errorf("control upstream socket: %w", err)
		}
		return serr
	}
}

// markFD sets mark (0: none) on the upstream socket fd.
func markFD(fd int, mark uint32, network, address string) error {
	if mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, int(mark)); err != nil {
			return fmt.Errorf("%w %#x for %s %s: %w", ErrMark, mark, network, address, err)
		}
	}
	if testHookControl != nil {
		testHookControl(uintptr(fd))
	}
	return nil
}
