package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// What the agent can tell about the bpffs it pins into, from
// /proc/self/mountinfo. The DaemonSet mounts the node's /sys/fs/bpf with
// HostToContainer propagation, which the container runtime refuses
// (CreateContainerError) unless the node's /sys/fs/bpf is a shared mount: the
// agent never starts then, and cannot report it. What it can report: no
// bpffs at all (ensureBPFFS fails, naming the node requirement), and, in a
// pod, a bpffs mount that is private to its container (a DaemonSet whose
// mountPropagation was changed): mounts the node makes there later do not
// reach it.

// mount is one line of /proc/self/mountinfo.
type mount struct {
	Point, FSType string
	// Propagation is "shared", "slave", "shared and slave", or "private".
	Propagation string
}

func (m mount) String() string { return fmt.Sprintf("%s (%s, %s)", m.Point, m.FSType, m.Propagation) }

// mountOf finds the mount that holds dir in mountinfo: the longest mount
// point that is dir or one of its parents (the last one mounted there).
func mountOf(mountinfo, dir string) (mount, bool) {
	dir = filepath.Clean(dir)
	var best mount
	found := false
	for _, line := range strings.Split(mountinfo, "\n") {
		m, ok := parseMountinfo(line)
		if !ok || !(dir == m.Point || strings.HasPrefix(dir, strings.TrimSuffix(m.Point, "/")+"/")) {
			continue
		}
		if !found || len(m.Point) >= len(best.Point) {
			best, found = m, true
		}
	}
	return best, found
}

// parseMountinfo reads "id parent maj:min root point options [optional...] -
// fstype source superoptions".
func parseMountinfo(line string) (mount, bool) {
	f := strings.Fields(line)
	sep := -1
	for i := 6; i < len(f); i++ {
		if f[i] == "-" {
			sep = i
			break
		}
	}
	if sep < 0 || sep+1 >= len(f) {
		return mount{}, false
	}
	var shared, slave bool
	for _, o := range f[6:sep] {
		shared = shared || strings.HasPrefix(o, "shared:")
		slave = slave || strings.HasPrefix(o, "master:")
	}
	prop := "private"
	switch {
	case shared && slave:
		prop = "shared and slave"
	case shared:
		prop = "shared"
	case slave:
		prop = "slave"
	}
	return mount{Point: unescapeMountinfo(f[4]), FSType: f[sep+1], Propagation: prop}, true
}

// unescapeMountinfo undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountinfo(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// bpffsWarning is what to warn about the bpffs mount m of a pin directory,
// or "". In a pod (inPod), a private mount means the DaemonSet's
// HostToContainer propagation is not in effect.
func bpffsWarning(m mount, inPod bool) string {
	if !inPod || m.Propagation != "private" {
		return ""
	}
	return fmt.Sprintf("the bpffs %s is a private mount in the agent's container: mounts the node makes on it later do not reach the agent. "+
		"The shipped DaemonSet mounts the node's /sys/fs/bpf with mountPropagation: HostToContainer, which needs the node's /sys/fs/bpf "+
		"to be a shared mount (findmnt -o TARGET,PROPAGATION /sys/fs/bpf; mount --make-shared /sys/fs/bpf)", m.Point)
}

// reportBPFFS logs the bpffs the agent pins into, warns when it is a private
// mount in a pod, and records it in the state (status shows it).
func (a *Agent) reportBPFFS() {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		a.log.Warn("cannot read the mounts to report the bpffs", "err", err)
		return
	}
	m, ok := mountOf(string(b), filepath.Dir(filepath.Clean(a.cfg.BPFFS)))
	if !ok {
		return
	}
	a.st.BPFFSMount = m.String()
	a.log.Info("pinning on bpffs", "mount", m.Point, "fstype", m.FSType, "propagation", m.Propagation)
	if w := bpffsWarning(m, a.cfg.InCluster); w != "" {
		a.log.Warn(w)
	}
}
