//go:build !linux

package upstream

import (
	"fmt"
	"syscall"
)

// testHookControl, when set by tests, is called with each upstream socket.
var testHookControl func(fd uintptr)

// control refuses a non-zero mark outside Linux: SO_MARK (which keeps our upstream
// queries out of the capture) exists only there. Without a mark it does nothing.
func control(mark uint32) func(network, address string, c syscall.RawConn) error {
	return func(network, address string, c syscall.RawConn) error {
		if mark != 0 {
			return fmt.Errorf("%w %#x for %s %s: SO_MARK is Linux-only", ErrMark, mark, network, address)
		}
		return nil
	}
}
