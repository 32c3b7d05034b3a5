//go:build linux

package ctzone

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// nsHandle pins the network namespace that Start programmed, so that run and
// Close (called from any goroutine) act on that namespace and no other.
type nsHandle struct {
	f *os.File
}

// openNetns opens path, or the calling thread's namespace when path is "".
func openNetns(path string) (*nsHandle, error) {
	if path == "" {
		path = fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid())
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open network namespace %s: %w", path, err)
	}
	return &nsHandle{f: f}, nil
}

func (h *nsHandle) close() error { return h.f.Close() }

// do runs fn on a thread switched into the namespace (child processes started
// by fn inherit it) and switches the thread back afterwards. A thread already
// in the namespace runs fn as it is: setns needs CAP_SYS_ADMIN, which the agent
// does not have (only CAP_NET_ADMIN) and does not need for its own namespace.
func (h *nsHandle) do(fn func() error) error {
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()))
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("open own network namespace: %w", err)
			return
		}
		defer self.Close()
		if sameFile(self, h.f) {
			ferr := fn()
			runtime.UnlockOSThread()
			done <- ferr
			return
		}
		if err := unix.Setns(int(h.f.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("enter network namespace: %w", err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			// Stay locked: the runtime throws this thread away when the goroutine ends.
			done <- errors.Join(ferr, fmt.Errorf("return to own network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}

// sameFile reports whether a and b are the same namespace (device and inode).
func sameFile(a, b *os.File) bool {
	var sa, sb unix.Stat_t
	if unix.Fstat(int(a.Fd()), &sa) != nil || unix.Fstat(int(b.Fd()), &sb) != nil {
		return false
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}
