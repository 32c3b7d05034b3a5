//go:build !linux

package cgroup2

import "errors"

// onCgroup2: cgroup v2 exists only on Linux.
func onCgroup2(string) (int64, bool, error) {
	return 0, false, errors.New("cgroup v2 needs Linux")
}
