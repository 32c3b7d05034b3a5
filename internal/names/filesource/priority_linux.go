package filesource

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// background runs fn to its end on an OS thread of its own at the lowest
// CPU priority (nice 19). A reload is work that can wait: on a core it
// shares with the resolver's reader threads (nice 0), the kernel gives the
// core to a woken reader at once instead of sharing it with the reload
// (measured in bench/RESULTS.md, section 10). While the reload
// holds the store's lock (a step of Sink.Apply) it runs at that priority
// too; lookups never take that lock. The thread ends with fn (a goroutine
// that returns while locked to its thread takes the thread with it), so no
// thread of the runtime's pool keeps the priority.
func background(fn func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		// Raising one's own nice value needs no privilege; should it fail
		// (a seccomp filter), the reload runs at the usual priority.
		_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 19)
		fn()
	}()
	<-done
}
