package workload

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
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

// PodTree is what a walk of the cgroup2 tree finds of kubelet's pods.
type PodTree struct {
	// Pods is each pod's own cgroup by pod UID: the outermost directory whose
	// name carries the UID (kubelet creates it before the pod's containers,
	// which are its children).
	Pods map[string]Cgroup
	// Parents are the directories where kubelet makes pods' cgroups, sorted:
	// the root, every directory above a pod's, and every other directory in
	// or below one named for kubepods (a QoS class's directory holds no pod
	// before its first). A watch of them sees a pod's cgroup made before its
	// containers start.
	Parents []string
}

// PodCgroups walks the cgroup2 tree under root and returns each pod's own
// cgroup and the directories where pods' cgroups are made. A directory that
// disappears during the walk is skipped.
func PodCgroups(root string) (PodTree, error) {
	tree := PodTree{Pods: map[string]Cgroup{}}
	parents := map[string]bool{root: true}
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
			if rel, _ := filepath.Rel(root, p); strings.Contains(rel, "kubepods") {
				parents[p] = true
			}
			return nil
		}
		if cg, ok := CgroupAt(p); ok {
			tree.Pods[uid] = cg
		}
		for dir := filepath.Dir(p); dir != root && strings.HasPrefix(dir, root); dir = filepath.Dir(dir) {
			parents[dir] = true
		}
		return filepath.SkipDir // its containers are below it
	})
	if err != nil {
		return PodTree{}, fmt.Errorf("walk cgroups under %s: %w", root, err)
	}
	tree.Parents = slices.Sorted(maps.Keys(parents))
	return tree, nil
}
