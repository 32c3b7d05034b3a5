package workload

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// Cgroup is one cgroup directory: its path and its cgroup v2 id (the
// directory's inode, what bpf_get_current_cgroup_id returns for its tasks).
type Cgroup struct {
	Path string
	ID   uint64
}

// CgroupAt is the cgroup directory at path, or false when there is none.
func CgroupAt(path string) (Cgroup, bool) {
	fi, err := os.Stat(path)
	if err != nil || !fi.IsDir() {
		return Cgroup{}, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return Cgroup{}, false
	}
	return Cgroup{Path: path, ID: st.Ino}, true
}

// PodCgroups walks the cgroup2 tree under root and returns each pod's own
// cgroup by pod UID: the outermost directory whose name carries the UID (kubelet
// creates it before the pod's containers, which are its children). A directory
// that disappears during the walk is skipped.
func PodCgroups(root string) (map[string]Cgroup, error) {
	pods := map[string]Cgroup{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == root || !errors.Is(err, fs.ErrNotExist) {
				return err
			}
			return nil // removed while we walked
		}
		if !d.IsDir() {
			return nil
		}
		uid := PodUID(d.Name())
		if uid == "" {
			return nil
		}
		if cg, ok := CgroupAt(p); ok {
			pods[uid] = cg
		}
		return filepath.SkipDir // its containers are below it
	})
	if err != nil {
		return nil, fmt.Errorf("walk cgroups under %s: %w", root, err)
	}
	return pods, nil
}
