//go:build linux

package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

const leakEnv = "MESHDNS_TESTENV_LEAK"

// TestLeakHelper is not a test of its own: run by TestStaleLeftoversRemoved with
// leakEnv set, it creates a netns and a cgroup with cgroups below it (as a
// node's pods are), prints their names and kills itself with SIGKILL, so its
// t.Cleanup never runs.
func TestLeakHelper(t *testing.T) {
	if os.Getenv(leakEnv) == "" {
		t.Skip("helper process of TestStaleLeftoversRemoved")
	}
	ns := NewNetns(t, "mdt-leak")
	cg := NewCgroup(t)
	if err := os.MkdirAll(filepath.Join(cg.Path, "kubepods.slice", "pod.slice"), 0o755); err != nil {
		t.Fatal(err)
	}
	fmt.Printf("LEAK %s %s\n", ns.Name, cg.Path)
	_ = os.Stdout.Sync()
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
}

// TestStaleLeftoversRemoved: a test process killed before its cleanup (SIGKILL,
// a timeout, a stopped run) leaves its netns and cgroup behind; the next test
// process that makes either removes them, and never one of a live process.
func TestStaleLeftoversRemoved(t *testing.T) {
	RequirePrivileged(t, "ip")
	cmd := exec.Command(os.Args[0], "-test.run=^TestLeakHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), leakEnv+"=1")
	out, _ := cmd.Output() // it dies by SIGKILL
	var nsName, cgPath string
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) == 3 && f[0] == "LEAK" {
			nsName, cgPath = f[1], f[2]
		}
	}
	if nsName == "" {
		t.Fatalf("the helper printed no names:\n%s", out)
	}
	t.Cleanup(func() { // whatever the sweep misses, this test does not leave
		_ = exec.Command("ip", "netns", "del", nsName).Run()
		_ = os.RemoveAll(filepath.Join("/etc/netns", nsName))
		_ = RemoveCgroupTree(cgPath)
	})
	if _, err := os.Stat(filepath.Join("/run/netns", nsName)); err != nil {
		t.Fatalf("the killed helper's netns %s is not there to sweep: %v", nsName, err)
	}
	if _, err := os.Stat(cgPath); err != nil {
		t.Fatalf("the killed helper's cgroup %s is not there to sweep: %v", cgPath, err)
	}
	live := NewNetns(t, "mdt-live")
	liveCg := NewCgroup(t)

	root, err := cgroup2.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	sweepStaleNetns(t)
	sweepStaleCgroups(t, root)

	if _, err := os.Stat(filepath.Join("/run/netns", nsName)); !os.IsNotExist(err) {
		t.Errorf("stale netns %s still there after the sweep (%v)", nsName, err)
	}
	if _, err := os.Stat(cgPath); !os.IsNotExist(err) {
		t.Errorf("stale cgroup %s still there after the sweep (%v)", cgPath, err)
	}
	if _, err := os.Stat(filepath.Join("/run/netns", live.Name)); err != nil {
		t.Errorf("the sweep removed this process's netns %s: %v", live.Name, err)
	}
	if _, err := os.Stat(liveCg.Path); err != nil {
		t.Errorf("the sweep removed this process's cgroup %s: %v", liveCg.Path, err)
	}
}
