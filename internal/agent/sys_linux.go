package agent

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ifaNoDAD: an IPv6 address usable at once (no duplicate address detection).
const ifaNoDAD = unix.IFA_F_NODAD

func effectiveCaps() (capSet, error) {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return capSet{}, fmt.Errorf("read capabilities: %w", err)
	}
	return capSet{data[0].Effective, data[1].Effective}, nil
}

// mountBPFFS mounts a bpf filesystem on dir, readable by root only.
func mountBPFFS(dir string) error {
	return unix.Mount("bpf", dir, "bpf", 0, "mode=0700")
}

func ofdLock(typ int16) *unix.Flock_t {
	return &unix.Flock_t{Type: typ, Whence: 0, Start: 0, Len: 0}
}

// setLock takes the state lock on f (an open file description lock, so it
// follows the descriptor through a handover and dies with the last holder);
// errLocked when another agent holds it.
func setLock(f *os.File) error {
	err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, ofdLock(unix.F_WRLCK))
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
		return errLocked
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
