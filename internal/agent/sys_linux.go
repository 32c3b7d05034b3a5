package agent

import (
	"fmt"

	"golang.org/x/sys/unix"
)

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
