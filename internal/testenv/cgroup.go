package testenv

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// Cgroup is a cgroup v2 directory created for one test.
type Cgroup struct {
	Path string   // absolute directory, e.g. /sys/fs/cgroup/unified/meshdns-test-1a2b3c
	dir  *os.File // open directory, for CLONE_INTO_CGROUP
}

// NewCgroup creates a child cgroup of the cgroup2 root for this test. At cleanup it
// kills every process left in it and removes it.
func NewCgroup(t testing.TB) *Cgroup {
	t.Helper()
	root, err := cgroup2.FindMount()
	if err != nil {
		Skip(t, "needs cgroup2: %v", err)
	}
	path := filepath.Join(root, "meshdns-test-"+RandSuffix(8))
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatalf("create cgroup %s: %v", path, err)
	}
	dir, err := os.Open(path)
	if err != nil {
		_ = os.Remove(path)
		t.Fatalf("open cgroup %s: %v", path, err)
	}
	cg := &Cgroup{Path: path, dir: dir}
	t.Cleanup(func() {
		dir.Close()
		if err := cg.remove(); err != nil {
			t.Errorf("remove cgroup %s: %v", path, err)
		}
	})
	return cg
}

// FD is the open directory of the cgroup, for exec.Cmd SysProcAttr.CgroupFD.
func (c *Cgroup) FD() int { return int(c.dir.Fd()) }

// Procs lists the pids in the cgroup.
func (c *Cgroup) Procs() []int {
	b, err := os.ReadFile(filepath.Join(c.Path, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

func (c *Cgroup) remove() error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		for _, pid := range c.Procs() {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		err := os.Remove(c.Path)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}
