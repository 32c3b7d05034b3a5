package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestDPEnv builds the datapath environment, runs a command through the
// client prefix (must land in the cgroup and the namespace), and checks that
// cleanup removes the namespace, the cgroup and the bpffs mount.
func TestDPEnv(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("needs root (netns, cgroup, bpffs); CI=true makes this a failure")
		}
		t.Skip("needs root (netns, cgroup, bpffs)")
	}
	env, err := newDPEnv(t.TempDir())
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skipf("datapath environment unavailable: %v", err)
	}
	t.Cleanup(func() { env.cleanup() })

	// The client prefix: cgroup membership and the namespace's lo address.
	argv := append(env.clientPrefix(), "sh", "-c", "cat /proc/self/cgroup; ip -o addr show dev lo")
	out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v: %s", argv, err, out)
	}
	cg := filepath.Base(env.cgroup)
	if !strings.Contains(string(out), "/"+cg) || !strings.Contains(string(out), dpNameserver+"/32") {
		t.Errorf("client not in cgroup %s / netns %s:\n%s", cg, env.ns, out)
	}
	// The direct client's sibling cgroup exists too.
	argv = append(env.prefixIn(env.direct), "cat", "/proc/self/cgroup")
	if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil || !strings.Contains(string(out), "/"+filepath.Base(env.direct)) {
		t.Errorf("direct client not in cgroup %s: %v: %s", env.direct, err, out)
	}
	mounts, _ := os.ReadFile("/proc/self/mounts")
	if !strings.Contains(string(mounts), env.bpffs+" bpf") {
		t.Errorf("bpffs not mounted at %s", env.bpffs)
	}

	if errs := env.cleanup(); len(errs) > 0 {
		t.Fatalf("cleanup: %v", errs)
	}
	for _, cg := range []string{env.cgroup, env.direct} {
		if _, err := os.Stat(cg); !os.IsNotExist(err) {
			t.Errorf("cgroup %s still exists: %v", cg, err)
		}
	}
	if _, err := os.Stat("/var/run/netns/" + env.ns); !os.IsNotExist(err) {
		t.Errorf("netns %s still exists: %v", env.ns, err)
	}
	mounts, _ = os.ReadFile("/proc/self/mounts")
	if strings.Contains(string(mounts), env.bpffs) {
		t.Errorf("bpffs %s still mounted", env.bpffs)
	}
}
