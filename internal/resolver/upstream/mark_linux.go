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
			if mark != 0 {
				if e := unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(mark)); e != nil {
					serr = fmt.Errorf("%w %#x for %s %s: %w", ErrMark, mark, network, address, e)
					return
				}
			}
			if testHookControl != nil {
				testHookControl(fd)
			}
		})
		if err != nil {
			return fmt.Errorf("control upstream socket: %w", err)
		}
		return serr
	}
}
