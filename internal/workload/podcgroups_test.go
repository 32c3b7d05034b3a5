package workload

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestPodCgroupsFindsEachPodsOwnDirectory: with either cgroup driver's names, a
// pod's outermost directory is found (not its containers'), other directories
// are not pods, and the directories where pods' cgroups are made are named.
func TestPodCgroupsFindsEachPodsOwnDirectory(t *testing.T) {
	root := t.TempDir()
	dirs := []string{
		"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a1b2c3d_1111_2222_3333_444455556666.slice/cri-containerd-abc.scope",
		"kubepods/burstable/pod0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff/0123456789ab",
		"kubepods/pod0123456789abcdef0123456789abcdef", // a static pod: a hash
		"system.slice/app.service",
		"kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice", // no pod yet
		"kubepods/besteffort", // no pod yet
	}
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	tree, err := PodCgroups(root)
	if err != nil {
		t.Fatal(err)
	}
	got := tree.Pods
	want := map[string]string{
		"0a1b2c3d-1111-2222-3333-444455556666": "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a1b2c3d_1111_2222_3333_444455556666.slice",
		"0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff": "kubepods/burstable/pod0a1b2c3d-aaaa-bbbb-cccc-ddddeeeeffff",
		"0123456789abcdef0123456789abcdef":     "kubepods/pod0123456789abcdef0123456789abcdef",
	}
	if len(got) != len(want) {
		t.Fatalf("found %v, want %v", got, want)
	}
	for uid, rel := range want {
		c, ok := got[uid]
		if !ok || c.Path != filepath.Join(root, rel) || c.ID != inodeOf(filepath.Join(root, rel)) || c.ID == 0 {
			t.Errorf("pod %s: got %+v, want %s and its inode", uid, c, rel)
		}
	}
	var parents []string
	for _, rel := range []string{"", "kubelet.slice/kubelet-kubepods.slice", "kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice",
		"kubepods", "kubepods.slice", "kubepods.slice/kubepods-besteffort.slice", "kubepods/burstable", "kubepods/besteffort"} {
		parents = append(parents, filepath.Join(root, rel))
	}
	slices.Sort(parents)
	if !slices.Equal(tree.Parents, parents) {
		t.Errorf("parents %q, want %q", tree.Parents, parents)
	}
	if _, err := PodCgroups(filepath.Join(root, "missing")); err == nil {
		t.Error("a root that does not exist: no error")
	}
}
