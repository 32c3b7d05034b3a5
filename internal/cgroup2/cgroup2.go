// Package cgroup2 finds the cgroup v2 hierarchy and names its cgroups: the one
// place that reads /proc/self/mountinfo for the cgroup2 mount, checks that a
// directory is on it, and resolves cgroup ids (the inode of a cgroup's
// directory) to paths, with a cache so repeated lookups do not walk the tree.
package cgroup2

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
)

// FindMount returns the mount point of the cgroup v2 hierarchy (the first
// cgroup2 mount whose root is the hierarchy's root), from /proc/self/mountinfo:
// /sys/fs/cgroup on pure v2 hosts, /sys/fs/cgroup/unified on hybrid ones.
func FindMount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	first := ""
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - fstype source super
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+1 >= len(fields) || len(fields) < 5 || fields[sep+1] != "cgroup2" {
			continue
		}
		mp := unescapeMount(fields[4])
		if fields[3] == "/" {
			return mp, nil
		}
		if first == "" {
			first = mp
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	if first != "" {
		return first, nil
	}
	return "", errors.New("no cgroup2 filesystem is mounted")
}

// unescapeMount undoes the octal escapes of /proc/self/mountinfo (\040 etc.).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// CheckDir reports a clear error unless dir is a directory on a cgroup2
// filesystem.
func CheckDir(dir string) error {
	fi, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cgroup directory %s does not exist", dir)
	}
	if err != nil {
		return fmt.Errorf("cgroup directory %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("cgroup path %s is not a directory", dir)
	}
	fsType, ok, err := onCgroup2(dir)
	if err != nil {
		return fmt.Errorf("statfs cgroup directory %s: %w", dir, err)
	}
	if !ok {
		hint := ""
		if m, err := FindMount(); err == nil {
			hint = fmt.Sprintf("; the cgroup2 hierarchy is mounted at %s", m)
		}
		return fmt.Errorf("cgroup directory %s is not on a cgroup2 filesystem (filesystem type %#x)%s", dir, fsType, hint)
	}
	return nil
}

// Namer resolves cgroup ids to directories. It remembers what it found, so a
// caller that names the same cgroups again and again (a metrics scrape, a
// status loop) walks the hierarchy only when it meets an id it has not seen.
// An id a walk did not find is not looked for again (cgroup ids are never
// reused); that memory is bounded. A remembered path counts only while its
// directory is still that cgroup: a cgroup removed and made again at the same
// path is a new cgroup with a new id, and the old id is gone. Safe for
// concurrent use.
type Namer struct {
	mu      sync.Mutex
	paths   map[uint64]string
	missing map[uint64]bool // ids a walk did not find
	walks   int
}

// maxMissing bounds the ids a Namer remembers as gone.
const maxMissing = 1 << 16

// NewNamer returns an empty Namer.
func NewNamer() *Namer {
	return &Namer{paths: map[uint64]string{}, missing: map[uint64]bool{}}
}

// Paths returns the directory of each id that exists; ids not found (cgroups
// removed since) are absent from the result.
func (n *Namer) Paths(ids []uint64) map[uint64]string {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make(map[uint64]string, len(ids))
	var want []uint64
	for _, id := range ids {
		if p, ok := n.paths[id]; ok {
			if fi, err := os.Stat(p); err == nil && inode(fi) == id {
				out[id] = p
				continue
			}
			delete(n.paths, id) // removed, or its path is another cgroup's now
		}
		if !n.missing[id] {
			want = append(want, id)
		}
	}
	if len(want) == 0 {
		return out
	}
	n.walks++
	if len(n.missing)+len(want) > maxMissing {
		clear(n.missing)
	}
	found := Walk(want)
	for _, id := range want {
		if p, ok := found[id]; ok {
			n.paths[id] = p
			out[id] = p
		} else {
			n.missing[id] = true
		}
	}
	return out
}

func inode(fi fs.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}

// Walks is how many times the Namer walked the hierarchy.
func (n *Namer) Walks() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.walks
}

// Walk resolves ids by walking the cgroup2 mount once: a cgroup's id is the
// inode number of its directory.
func Walk(ids []uint64) map[uint64]string {
	out := map[uint64]string{}
	if len(ids) == 0 {
		return out
	}
	want := map[uint64]bool{}
	for _, id := range ids {
		want[id] = true
	}
	root, err := FindMount()
	if err != nil {
		return out
	}
	_ = filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if p == root {
				return err
			}
			return fs.SkipDir
		}
		if !e.IsDir() {
			return nil
		}
		fi, err := e.Info()
		if err != nil {
			return nil
		}
		if ino := inode(fi); want[ino] {
			out[ino] = p
			if len(out) == len(want) {
				return fs.SkipAll
			}
		}
		return nil
	})
	return out
}
