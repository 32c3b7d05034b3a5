//go:build linux

package nodetest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// setupNetwork makes the node's network namespace: loopback, and a veth "eth0"
// with the node IP whose other end sits in a namespace of its own (the
// default route's gateway), so the node has a real non-loopback address and
// nothing joins the machine's own namespace.
func (n *Node) setupNetwork(t testing.TB) {
	t.Helper()
	gw := testenv.NewNetns(t, "nodetest-gw")
	n.Netns = testenv.NewNetns(t, "nodetest")
	testenv.Veth(t, n.Netns, "eth0", NodeIP+"/24", gw, "eth0", gatewayIP+"/24")
	n.Netns.IP(t, "route", "add", "default", "via", gatewayIP)
}

// fakedSysctls are what kubelet (protectKernelDefaults: false) rewrites at start
// (pkg/kubelet/cm setupKernelTunables). /proc/sys is not per mount namespace:
// without files bind-mounted over them it would change the machine's.
var fakedSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
}

// setupMountNS makes the persistent private mount namespace every node process
// runs in, and mounts what keeps the node's files off the machine.
func (n *Node) setupMountNS(t testing.TB, opts Options) {
	t.Helper()
	nsDir := filepath.Join(n.Dir, "ns")
	for _, d := range []string{nsDir, "varlib-upper", "varlib-work", "log", "sysctl"} {
		if !filepath.IsAbs(d) {
			d = filepath.Join(n.Dir, d)
		}
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatalf("nodetest: %v", err)
		}
	}
	// A namespace file can only be bind-mounted on a private mount: the
	// directory becomes one.
	if err := unix.Mount(nsDir, nsDir, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("nodetest: bind %s: %v", nsDir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(nsDir, unix.MNT_DETACH); err != nil {
			t.Errorf("nodetest: unmount %s: %v", nsDir, err)
		}
	})
	if err := unix.Mount("", nsDir, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatalf("nodetest: make %s private: %v", nsDir, err)
	}
	n.MountNS = filepath.Join(nsDir, "mnt")
	if err := os.WriteFile(n.MountNS, nil, 0o644); err != nil {
		t.Fatalf("nodetest: %v", err)
	}
	if out, err := exec.Command("unshare", "--mount="+n.MountNS, "--propagation", "private", "true").CombinedOutput(); err != nil {
		t.Fatalf("nodetest: unshare: %v: %s", err, out)
	}
	t.Cleanup(func() {
		// Dropping the last reference ends the namespace with all its mounts: the
		// overlay, the sysctl files, the bpffs and its pins.
		if err := unix.Unmount(n.MountNS, unix.MNT_DETACH); err != nil {
			t.Errorf("nodetest: unmount %s: %v", n.MountNS, err)
		}
	})
	var script []string
	for _, s := range fakedSysctls {
		cur, err := os.ReadFile(filepath.Join("/proc/sys", s))
		if err != nil {
			t.Fatalf("nodetest: %v", err)
		}
		fake := filepath.Join(n.Dir, "sysctl", strings.ReplaceAll(s, "/", "."))
		if err := os.WriteFile(fake, cur, 0o644); err != nil {
			t.Fatalf("nodetest: %v", err)
		}
		script = append(script, fmt.Sprintf("mount --bind %s /proc/sys/%s", fake, s))
	}
	bpfProp := "--make-private"
	if opts.SharedBPFFS {
		bpfProp = "--make-shared"
	}
	script = append(script,
		fmt.Sprintf("mount -t overlay overlay -o lowerdir=/var/lib,upperdir=%s,workdir=%s /var/lib",
			filepath.Join(n.Dir, "varlib-upper"), filepath.Join(n.Dir, "varlib-work")),
		"mount --bind "+filepath.Join(n.Dir, "log")+" /var/log",
		// containerd's and kubelet's run-time files, the agent's state and the
		// xtables lock: a /run of the node's own.
		"mount -t tmpfs -o mode=0755 tmpfs /run",
		"mount -t bpf -o mode=0700 bpf /sys/fs/bpf",
		"mount "+bpfProp+" /sys/fs/bpf",
	)
	if out, err := exec.Command("nsenter", "--mount="+n.MountNS, "--", "sh", "-ec", strings.Join(script, "\n")).CombinedOutput(); err != nil {
		t.Fatalf("nodetest: set up the mount namespace: %v: %s", err, out)
	}
	n.checkMountNS(t)
}

// checkMountNS refuses to go on unless, inside the node, every faked sysctl is a
// mount of its own (a write by kubelet lands in the node's file) and /var/lib,
// /run and /sys/fs/bpf are the node's.
func (n *Node) checkMountNS(t testing.TB) {
	t.Helper()
	out, err := exec.Command("nsenter", "--mount="+n.MountNS, "--", "cat", "/proc/self/mountinfo").Output()
	if err != nil {
		t.Fatalf("nodetest: read the node's mounts: %v", err)
	}
	mounted := map[string]bool{}
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) > 4 {
			mounted[f[4]] = true
		}
	}
	want := []string{"/var/lib", "/var/log", "/run", "/sys/fs/bpf"}
	for _, s := range fakedSysctls {
		want = append(want, "/proc/sys/"+s)
	}
	for _, w := range want {
		if !mounted[w] {
			t.Fatalf("nodetest: %s is not mounted inside the node: refusing to start kubelet, it would change the machine's", w)
		}
	}
}

// cgroupHierarchies are the v1 hierarchies kubelet's cgroupfs driver uses, and
// the unified one (where runc also places every container on a hybrid host).
var cgroupHierarchies = []string{"cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd", "unified"}

// setupCgroups makes the node's cgroup root in every hierarchy (cpuset's with
// its parent's cpus and mems) and a "system" child in the unified one for the
// node's daemons, and removes them all, depth first, at cleanup: that also
// kills every process left in them (containers, shims).
func (n *Node) setupCgroups(t testing.TB) {
	t.Helper()
	n.CgroupRoot = "/" + n.Name
	var made []string
	t.Cleanup(func() {
		for i := len(made) - 1; i >= 0; i-- {
			if err := testenv.RemoveCgroupTree(made[i]); err != nil {
				t.Errorf("nodetest: %v", err)
			}
		}
	})
	for _, h := range cgroupHierarchies {
		base := filepath.Join("/sys/fs/cgroup", h)
		if _, err := os.Stat(base); err != nil {
			continue
		}
		dir := filepath.Join(base, n.Name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatalf("nodetest: %v", err)
		}
		made = append(made, dir)
		if h == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(base, f))
				if err == nil {
					err = os.WriteFile(filepath.Join(dir, f), b, 0o644)
				}
				if err != nil {
					t.Fatalf("nodetest: %s: %v", f, err)
				}
			}
		}
		if h == "unified" {
			n.UnifiedRoot = dir
		}
	}
	if n.UnifiedRoot == "" {
		testenv.Skip(t, "nodetest: no cgroup2 hierarchy at /sys/fs/cgroup/unified (the node test needs a hybrid cgroup host)")
	}
	if err := os.Mkdir(filepath.Join(n.UnifiedRoot, "system"), 0o755); err != nil {
		t.Fatalf("nodetest: %v", err)
	}
}

// sweepStale removes what a node test process killed before its cleanup (a
// timeout, SIGKILL) left: its mount namespace, its cgroup trees, its directory.
// Its network namespaces go with testenv's own sweep.
func sweepStale(t testing.TB) {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), "nodetest-t*"))
	for _, dir := range dirs {
		name := filepath.Base(dir)
		if !testenv.StaleOwner(name) {
			continue
		}
		_ = unix.Unmount(filepath.Join(dir, "ns", "mnt"), unix.MNT_DETACH)
		_ = unix.Unmount(filepath.Join(dir, "ns"), unix.MNT_DETACH)
		for _, h := range cgroupHierarchies {
			if err := testenv.RemoveCgroupTree(filepath.Join("/sys/fs/cgroup", h, name)); err != nil {
				t.Logf("nodetest: remove a stale node's cgroup: %v", err)
			}
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Logf("nodetest: remove a stale node's directory: %v", err)
			continue
		}
		t.Logf("nodetest: removed node %s, left by a test process that is gone", name)
	}
}
