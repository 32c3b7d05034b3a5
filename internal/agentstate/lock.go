package agentstate

import (
	"errors"
	"fmt"
	"os"
)

// Lock is the lock that says an agent runs with a state directory: an
// open-file-description lock (F_OFD_SETLK, like flock: it belongs to the open
// file, not to a pid) on agent.lock, held for the agent's lifetime. The kernel
// drops it when the last descriptor of that open file is closed, whatever
// killed the process, so a crashed agent never blocks the next one, even when
// every agent is pid 1 of its own container. Passing the descriptor to a
// successor (SCM_RIGHTS) hands the lock over without a moment unlocked.
type Lock struct {
	f *os.File
}

// ErrLocked means another process holds the lock.
var ErrLocked = errors.New("another meshdns-ebpf agent holds the state lock")

// openLockFile opens (creating) dir/agent.lock.
func openLockFile(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create state dir %s: %w", dir, err)
	}
	f, err := os.OpenFile(LockPath(dir), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open state lock: %w", err)
	}
	return f, nil
}

// TryLock takes the lock of dir without waiting: ErrLocked when another
// agent holds it.
func TryLock(dir string) (*Lock, error) {
	f, err := openLockFile(dir)
	if err != nil {
		return nil, err
	}
	if err := setLock(f); err != nil {
		f.Close()
		if errors.Is(err, ErrLocked) {
			return nil, ErrLocked
		}
		return nil, fmt.Errorf("lock %s: %w", LockPath(dir), err)
	}
	return &Lock{f: f}, nil
}

// Adopt wraps a descriptor of the lock file received from the agent that
// held it: the lock is ours from then on.
func Adopt(f *os.File) *Lock { return &Lock{f: f} }

// File is the lock's open file, to pass to a successor; nil once released.
func (l *Lock) File() *os.File { return l.f }

// Release drops our descriptor: the lock is released unless a successor holds
// another descriptor of the same open file. A nil or released lock is no error.
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// Locked reports whether an agent holds the state lock of dir, without taking
// it (F_OFD_GETLK), so asking never gets in the way of an agent starting.
func Locked(dir string) (bool, error) {
	f, err := os.OpenFile(LockPath(dir), os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open state lock: %w", err)
	}
	defer f.Close()
	held, err := lockHeld(f)
	if err != nil {
		return false, fmt.Errorf("query state lock: %w", err)
	}
	return held, nil
}
