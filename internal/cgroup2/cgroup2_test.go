package cgroup2_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

func inode(t *testing.T, p string) uint64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

// The Namer walks the hierarchy only for ids it has not seen: naming the same
// cgroups on every metrics scrape costs a stat each, not a walk.
func TestNamerCaches(t *testing.T) {
	testenv.RequirePrivileged(t)
	parent := testenv.NewCgroup(t)
	a := filepath.Join(parent.Path, "a")
	b := filepath.Join(parent.Path, "b")
	for _, d := range []string{a, b} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(d) })
	}
	ia, ib := inode(t, a), inode(t, b)
	n := cgroup2.NewNamer()
	got := n.Paths([]uint64{ia, ib})
	if got[ia] != a || got[ib] != b || n.Walks() != 1 {
		t.Fatalf("first Paths: %v after %d walks", got, n.Walks())
	}
	for i := 0; i < 5; i++ {
		got = n.Paths([]uint64{ia, ib, 1 << 62})
	}
	if got[ia] != a || got[ib] != b || n.Walks() != 2 {
		t.Errorf("repeated Paths: %v after %d walks, want 2 (one more for the unknown id, then none)", got, n.Walks())
	}
	if err := os.Remove(b); err != nil {
		t.Fatal(err)
	}
	got = n.Paths([]uint64{ia, ib})
	if _, ok := got[ib]; ok || got[ia] != a {
		t.Errorf("after removing %s: %v", b, got)
	}
}

func TestCheckDir(t *testing.T) {
	if err := cgroup2.CheckDir("/nonexistent-meshdns"); err == nil {
		t.Error("CheckDir on a missing directory succeeded")
	}
	if err := cgroup2.CheckDir(t.TempDir()); err == nil {
		t.Error("CheckDir on a tmpfs directory succeeded")
	}
	if root, err := cgroup2.FindMount(); err == nil {
		if err := cgroup2.CheckDir(root); err != nil {
			t.Errorf("CheckDir(%s): %v", root, err)
		}
	}
}

// A cgroup removed and made again at the same path is a new cgroup with a new
// id: the cached path of the old id must not name the new one.
func TestNamerForgetsAReplacedCgroup(t *testing.T) {
	testenv.RequirePrivileged(t)
	cg := testenv.NewCgroup(t)
	p := filepath.Join(cg.Path, "unit")
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatal(err)
	}
	old := inode(t, p)
	n := cgroup2.NewNamer()
	if got := n.Paths([]uint64{old})[old]; got != p {
		t.Fatalf("Paths(%d) = %q, want %s", old, got, p)
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(p) })
	renewed := inode(t, p)
	if renewed == old {
		t.Fatalf("the kernel gave the new cgroup the old id %d", old)
	}
	got := n.Paths([]uint64{old, renewed})
	if q, ok := got[old]; ok {
		t.Errorf("Paths names removed cgroup %d as %s, which is now cgroup %d", old, q, renewed)
	}
	if got[renewed] != p {
		t.Errorf("Paths(%d) = %q, want %s", renewed, got[renewed], p)
	}
}
