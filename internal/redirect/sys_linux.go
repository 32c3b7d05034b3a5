package redirect

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Linux ABI values the probe programs and maps use.
const (
	solSocket     = unix.SOL_SOCKET
	soMark        = unix.SO_MARK
	bpfNoPrealloc = unix.BPF_F_NO_PREALLOC
	// bpfQueryEffective: BPF_PROG_QUERY lists what runs for the cgroup (its own
	// programs, then its ancestors'), not only what is attached to it.
	bpfQueryEffective = unix.BPF_F_QUERY_EFFECTIVE
)

// OnBPFFS reports p's filesystem type and whether it is a bpffs.
func OnBPFFS(p string) (fsType int64, ok bool, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		return 0, false, err
	}
	return int64(st.Type), st.Type == unix.BPF_FS_MAGIC, nil
}

// ownNetnsCookie is the cookie of the calling thread's network namespace.
func ownNetnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fd, err = unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return 0, fmt.Errorf("open socket: %w", err)
		}
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("getsockopt SO_NETNS_COOKIE (needs Linux 5.14): %w", err)
	}
	return c, nil
}
