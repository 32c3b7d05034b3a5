//go:build linux

package testenv

import (
	"bufio"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// MemCgroup is a cgroup v1 memory group created for one test, with a memory limit.
// (Where the cgroup2 mount lacks the memory controller, as on this project's machines,
// only the v1 hierarchy can limit a process's memory.)
type MemCgroup struct {
	Path  string // the group's directory
	Limit int64
}

// NewMemCgroup creates a v1 memory group limited to limit bytes (swap included where
// the kernel accounts it). It uses the mounted v1 memory hierarchy, or mounts one in a
// temporary directory for the test. At cleanup it kills the group's processes, removes
// the group and unmounts what it mounted.
func NewMemCgroup(t testing.TB, limit int64) *MemCgroup {
	t.Helper()
	if os.Geteuid() != 0 {
		Skip(t, "a memory cgroup needs root (running as uid %d)", os.Geteuid())
	}
	root, err := memoryV1Mount()
	if err != nil {
		dir := t.TempDir()
		if err := syscall.Mount("meshdns-memcg", dir, "cgroup", 0, "memory"); err != nil {
			Skip(t, "no cgroup v1 memory hierarchy and mounting one failed: %v", err)
		}
		t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
		root = dir
	}
	sweepMemCgroupsOnce.Do(func() { sweepStaleCgroups(t, root) })
	cg := &MemCgroup{Path: filepath.Join(root, OwnedName("meshdns-test", 8)), Limit: limit}
	if err := os.Mkdir(cg.Path, 0o755); err != nil {
		t.Fatalf("create memory cgroup: %v", err)
	}
	t.Cleanup(func() {
		if err := cg.remove(); err != nil {
			t.Errorf("remove memory cgroup %s: %v", cg.Path, err)
		}
	})
	if err := cg.write("memory.limit_in_bytes", strconv.FormatInt(limit, 10)); err != nil {
		t.Fatalf("set memory limit: %v", err)
	}
	// With swap accounting the limit covers swap too, so the group cannot escape it.
	_ = cg.write("memory.memsw.limit_in_bytes", strconv.FormatInt(limit, 10))
	return cg
}

func memoryV1Mount() (string, error) {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 4 && fields[2] == "cgroup" && hasOption(fields[3], "memory") {
			return fields[1], nil
		}
	}
	return "", errors.New("no cgroup v1 memory mount")
}

func hasOption(opts, want string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == want {
			return true
		}
	}
	return false
}

func (c *MemCgroup) write(file, v string) error {
	return os.WriteFile(filepath.Join(c.Path, file), []byte(v), 0o644)
}

// Int reads a numeric file of the group (memory.max_usage_in_bytes, memory.failcnt...).
func (c *MemCgroup) Int(file string) int64 {
	b, err := os.ReadFile(filepath.Join(c.Path, file))
	if err != nil {
		return -1
	}
	v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return v
}

// ResetPeak restarts the group's peak usage and failure counters.
func (c *MemCgroup) ResetPeak() {
	_ = c.write("memory.max_usage_in_bytes", "0")
	_ = c.write("memory.failcnt", "0")
}

// OOMKills returns the group's oom_kill count (memory.oom_control), -1 if unknown.
func (c *MemCgroup) OOMKills() int64 {
	b, err := os.ReadFile(filepath.Join(c.Path, "memory.oom_control"))
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "oom_kill" {
			v, _ := strconv.ParseInt(f[1], 10, 64)
			return v
		}
	}
	return -1
}

// JoinCommand wraps argv so the process joins the group before exec: run it with
// exec.Command(cg.JoinCommand(argv)...).
func (c *MemCgroup) JoinCommand(argv ...string) []string {
	return append([]string{"/bin/sh", "-c", `echo $$ > "$0/cgroup.procs" && shift && exec "$@"`, c.Path, "--"}, argv...)
}

func (c *MemCgroup) remove() error { return removeCgroupDir(c.Path) }

var sweepMemCgroupsOnce sync.Once
