//go:build linux

package testenv

import (
	"testing"

	"golang.org/x/sys/unix"
)

// NewBPFFS mounts a private bpffs instance on a temporary directory and returns it;
// pins made there never touch /sys/fs/bpf. It is unmounted at cleanup.
func NewBPFFS(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		Skip(t, "mount bpffs on %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount bpffs %s: %v", dir, err)
		}
	})
	return dir
}
