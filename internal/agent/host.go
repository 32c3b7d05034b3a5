package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Capabilities the agent needs per mode.
const (
	capNetAdmin = 12
	capSysAdmin = 21
	capBPF      = 39
)

// checkPrivileges returns a clear error when the process lacks what the mode needs.
func checkPrivileges(mode string) error {
	if mode == ModeOff {
		return nil
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("read capabilities: %w", err)
	}
	has := func(c uint) bool { return data[c/32].Effective&(1<<(c%32)) != 0 }
	var missing []string
	if !has(capNetAdmin) {
		missing = append(missing, "CAP_NET_ADMIN")
	}
	if mode != ModeIptables && !has(capBPF) && !has(capSysAdmin) {
		missing = append(missing, "CAP_BPF (or CAP_SYS_ADMIN)")
	}
	if mode != ModeIptables && !has(capSysAdmin) {
		missing = append(missing, "CAP_SYS_ADMIN (attach to cgroups, mount bpffs)")
	}
	if len(missing) > 0 {
		return fmt.Errorf("meshdns-ebpf run --mode %s must run as root or with %s (running as uid %d)", mode, strings.Join(missing, ", "), os.Geteuid())
	}
	return nil
}

// ensureBPFFS makes sure pinDir's parent is on a bpffs. The default location's parent,
// /sys/fs/bpf, is mounted when it is not (as Cilium does); any other location must
// already be a bpffs.
func ensureBPFFS(pinDir string) (mounted bool, err error) {
	parent := filepath.Dir(filepath.Clean(pinDir))
	if isBPFFS(parent) {
		return false, nil
	}
	if parent != "/sys/fs/bpf" {
		return false, fmt.Errorf("--bpffs %s: %s is not on a bpf filesystem (mount one with: mount -t bpf bpf %s)", pinDir, parent, parent)
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return false, fmt.Errorf("create %s: %w", parent, err)
	}
	if err := unix.Mount("bpf", parent, "bpf", 0, "mode=0700"); err != nil {
		return false, fmt.Errorf("mount bpffs on %s: %w", parent, err)
	}
	return true, nil
}

func isBPFFS(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	return st.Type == unix.BPF_FS_MAGIC
}
