package agentstate

import (
	"errors"
	"os"

	"golang.org/x/sys/unix"
)

func ofdLock(typ int16) *unix.Flock_t {
	return &unix.Flock_t{Type: typ, Whence: 0, Start: 0, Len: 0}
}

// setLock takes the state lock on f (an open file description lock, so it
// follows the descriptor through a handover and dies with the last holder);
// ErrLocked when another agent holds it.
func setLock(f *os.File) error {
	err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, ofdLock(unix.F_WRLCK))
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
		return ErrLocked
	}
	return err
}

// lockHeld reports whether someone holds the state lock of f, without taking it.
func lockHeld(f *os.File) (bool, error) {
	lk := ofdLock(unix.F_WRLCK)
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, lk); err != nil {
		return false, err
	}
	return lk.Type != unix.F_UNLCK, nil
}
