package ctzone

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// nsHandle pins the network namespace that Install programmed, so that Run and
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
// by fn inherit it) and switches the thread back afterwards.
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
