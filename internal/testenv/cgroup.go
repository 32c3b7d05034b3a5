package testenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// Cgroup is a cgroup v2 directory created for one test.
type Cgroup struct {
	Path string   // absolute directory, e.g. /sys/fs/cgroup/unified/meshdns-test-t4242-1a2b3c4d
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
	sweepCgroupsOnce.Do(func() { sweepStaleCgroups(t, root) })
	return makeCgroup(t, filepath.Join(root, OwnedName("meshdns-test", 8)))
}

// makeCgroup creates the cgroup directory path and removes it at cleanup,
// thawing and killing what is left in it.
func makeCgroup(t testing.TB, path string) *Cgroup {
	t.Helper()
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
		_ = os.WriteFile(filepath.Join(path, "cgroup.freeze"), []byte("0"), 0o644)
		dir.Close()
		if err := cg.remove(); err != nil {
			t.Errorf("remove cgroup %s: %v", path, err)
		}
	})
	return cg
}

// Child creates the child cgroup name of c for this test; it is removed at
// cleanup (before c, which was created first), thawed if a test froze it.
func (c *Cgroup) Child(t testing.TB, name string) *Cgroup {
	t.Helper()
	return makeCgroup(t, filepath.Join(c.Path, name))
}

// ID is the cgroup's id: the inode number of its directory, what
// bpf_get_current_cgroup_id returns for its tasks.
func (c *Cgroup) ID(t testing.TB) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(c.dir.Fd()), &st); err != nil {
		t.Fatalf("stat cgroup %s: %v", c.Path, err)
	}
	return st.Ino
}

// SetFrozen freezes (true) or thaws every process of the cgroup with the
// cgroup v2 freezer, and waits until the kernel reports it done.
func (c *Cgroup) SetFrozen(t testing.TB, frozen bool) {
	t.Helper()
	v, want := "0", "frozen 0"
	if frozen {
		v, want = "1", "frozen 1"
	}
	if err := os.WriteFile(filepath.Join(c.Path, "cgroup.freeze"), []byte(v), 0o644); err != nil {
		Skip(t, "needs the cgroup v2 freezer: %v", err)
	}
	if !WaitFor(5*time.Second, func() bool {
		b, err := os.ReadFile(filepath.Join(c.Path, "cgroup.events"))
		return err == nil && strings.Contains(string(b), want)
	}) {
		t.Fatalf("cgroup %s: not %q within 5 s", c.Path, want)
	}
}

// FD is the open directory of the cgroup, for exec.Cmd SysProcAttr.CgroupFD.
func (c *Cgroup) FD() int { return int(c.dir.Fd()) }

func (c *Cgroup) remove() error { return removeCgroupDir(c.Path) }

// removeCgroupDir kills the processes in the cgroup directory path (v1 or v2) and
// removes it, retrying for up to 5 s while they exit.
func removeCgroupDir(path string) error {
	var err error
	var pids []string
	if Poll(5*time.Second, 20*time.Millisecond, func() bool {
		b, _ := os.ReadFile(filepath.Join(path, "cgroup.procs"))
		pids = strings.Fields(string(b))
		for _, p := range pids {
			if pid, err := strconv.Atoi(p); err == nil {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		err = os.Remove(path)
		return err == nil || errors.Is(err, os.ErrNotExist)
	}) {
		return nil
	}
	return fmt.Errorf("%w (processes %v)", err, pids)
}

var sweepCgroupsOnce sync.Once

// sweepStaleCgroups removes the test cgroups under root that test processes killed
// before their cleanup left behind.
func sweepStaleCgroups(t testing.TB, root string) {
	entries, _ := os.ReadDir(root)
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), "meshdns-test-") || !StaleOwner(e.Name()) {
			continue
		}
		path := filepath.Join(root, e.Name())
		if err := RemoveCgroupTree(path); err != nil { // a node test's has its pods' below it
			t.Logf("remove stale cgroup %s: %v", path, err)
			continue
		}
		t.Logf("removed cgroup %s, left by a test process that is gone", path)
	}
}

// RemoveCgroupTree removes the cgroup directory path (v1 or v2) and every cgroup
// below it, deepest first, killing the processes in each (removeCgroupDir).
func RemoveCgroupTree(path string) error {
	entries, err := os.ReadDir(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	for _, e := range entries {
		if e.IsDir() {
			if err := RemoveCgroupTree(filepath.Join(path, e.Name())); err != nil {
				return err
			}
		}
	}
	if err := removeCgroupDir(path); err != nil {
		return fmt.Errorf("remove cgroup %s: %w", path, err)
	}
	return nil
}
