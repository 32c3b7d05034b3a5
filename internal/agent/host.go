package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// capability is one Linux capability the agent may need, with why.
type capability struct {
	bit  uint
	name string
	why  string
}

var (
	capNetBindService = capability{10, "CAP_NET_BIND_SERVICE", "listen on a port below %d"}
	capNetAdmin       = capability{12, "CAP_NET_ADMIN", "attach to cgroups, register the resolver's sockets, SO_MARK, the dummy link and its address"}
	capNetAdminIpt    = capability{12, "CAP_NET_ADMIN", "iptables rules, conntrack, SO_MARK, the dummy link and its address"}
	capNetRaw         = capability{13, "CAP_NET_RAW", "the legacy iptables backend (its tools open a raw socket); not needed with --iptables-backend nft"}
	capSysAdmin       = capability{21, "CAP_SYS_ADMIN", "mount a bpffs"}
	capBPF            = capability{39, "CAP_BPF", "load the eBPF programs and create their maps"}
)

// capSet is the process's effective capability set.
type capSet [2]uint32

func (c capSet) has(cp capability) bool { return c[cp.bit/32]&(1<<(cp.bit%32)) != 0 }

// unprivilegedPortStart is net.ipv4.ip_unprivileged_port_start of this network
// namespace: ports below it need CAP_NET_BIND_SERVICE.
func unprivilegedPortStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_unprivileged_port_start")
	if err != nil {
		return 1024
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 1024
	}
	return n
}

// requiredCaps lists what mode needs: eBPF mode CAP_BPF and CAP_NET_ADMIN,
// iptables mode CAP_NET_ADMIN (and CAP_NET_RAW unless the nft backend is
// forced), both CAP_NET_BIND_SERVICE when a listen port is privileged. Mode off
// needs only the last. CAP_SYS_ADMIN is never required (only to mount a bpffs
// that is not mounted yet, checked where that happens).
func requiredCaps(mode, iptablesBackend string, ports []uint16) []capability {
	var need []capability
	switch mode {
	case ModeEBPF:
		need = append(need, capBPF, capNetAdmin)
	case ModeIptables:
		need = append(need, capNetAdminIpt)
		if iptablesBackend != "nft" {
			need = append(need, capNetRaw)
		}
	case ModeAuto:
		need = append(need, capNetAdmin) // eBPF needs CAP_BPF on top, else iptables
	}
	start := unprivilegedPortStart()
	for _, p := range ports {
		if int(p) < start {
			c := capNetBindService
			c.why = fmt.Sprintf(c.why, start)
			need = append(need, c)
			break
		}
	}
	return need
}

// checkPrivileges returns an error naming every capability the process lacks
// for mode, e.g. "--mode ebpf needs CAP_BPF (load the eBPF programs ...); the
// agent has CAP_NET_ADMIN, CAP_NET_BIND_SERVICE". Documented in README.md.
func checkPrivileges(mode, iptablesBackend string, ports []uint16) error {
	have, err := effectiveCaps()
	if err != nil {
		return err
	}
	var missing []string
	for _, c := range requiredCaps(mode, iptablesBackend, ports) {
		if !have.has(c) {
			missing = append(missing, c.name+" ("+c.why+")")
		}
	}
	if len(missing) == 0 {
		return nil
	}
	var has []string
	for _, c := range []capability{capBPF, capNetAdmin, capNetRaw, capNetBindService, capSysAdmin} {
		if have.has(c) {
			has = append(has, c.name)
		}
	}
	if len(has) == 0 {
		has = append(has, "none of these")
	}
	return fmt.Errorf("meshdns-ebpf run --mode %s needs %s; it runs as uid %d with %s",
		mode, strings.Join(missing, " and "), os.Geteuid(), strings.Join(has, ", "))
}

// hasCap reports whether the process has c in its effective set.
func hasCap(c capability) bool {
	have, err := effectiveCaps()
	return err == nil && have.has(c)
}

// ensureBPFFS makes sure pinDir's parent is on a bpffs. The default location's
// parent, /sys/fs/bpf, is mounted when it is not (as Cilium does), which needs
// CAP_SYS_ADMIN; any other location must already be a bpffs.
func ensureBPFFS(pinDir string) (mounted bool, err error) {
	parent := filepath.Dir(filepath.Clean(pinDir))
	if _, ok, _ := redirect.OnBPFFS(parent); ok {
		return false, nil
	}
	if parent != "/sys/fs/bpf" {
		return false, fmt.Errorf("--bpffs %s: %s is not on a bpf filesystem (mount one with: mount -t bpf bpf %s)", pinDir, parent, parent)
	}
	if !hasCap(capSysAdmin) {
		return false, fmt.Errorf("--bpffs %s: no bpf filesystem is mounted at %s, and mounting one needs CAP_SYS_ADMIN, which the agent does not have (and need not: mount it for the agent, e.g. mount -t bpf bpf %s; in Kubernetes the node must have a bpffs at /sys/fs/bpf, as a shared mount, for the DaemonSet's /sys/fs/bpf hostPath)", pinDir, parent, parent)
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return false, fmt.Errorf("create %s: %w", parent, err)
	}
	if err := mountBPFFS(parent); err != nil {
		return false, fmt.Errorf("mount bpffs on %s: %w", parent, err)
	}
	return true, nil
}
