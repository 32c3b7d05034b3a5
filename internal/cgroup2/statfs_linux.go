package cgroup2

import "golang.org/x/sys/unix"

// onCgroup2 reports dir's filesystem type and whether it is cgroup2.
func onCgroup2(dir string) (fsType int64, ok bool, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, false, err
	}
	return int64(st.Type), st.Type == unix.CGROUP2_SUPER_MAGIC, nil
}
