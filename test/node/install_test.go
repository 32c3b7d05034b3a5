package node

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// overlay writes the test node's kustomization over the shipped deploy/kubernetes
// into dir and returns dir. It changes exactly two things:
//
//   - images: localhost/meshdns-ebpf gets newTag tag (what `kustomize edit set
//     image` writes), the image imported into the node's containerd;
//   - the DaemonSet's volume "cgroup" gets hostPath.path = cgroupDir, the node's
//     pod cgroup root in the unified hierarchy, instead of /sys/fs/cgroup (the
//     machine's root cgroup, which the agent must never capture here). The
//     container's --cgroup=/host/cgroup stays as shipped.
//
// Both are strategic-merge or image fields that survive other changes to the
// base (a nodeSelector, security profiles, a memory limit).
func overlay(t *testing.T, root, dir, tag, cgroupDir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	base, err := filepath.Rel(dir, filepath.Join(root, "deploy", "kubernetes"))
	if err != nil {
		t.Fatal(err)
	}
	k := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
images:
  - name: %s
    newTag: %s
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: meshdns-ebpf
        namespace: meshdns-system
      spec:
        template:
          spec:
            volumes:
              - name: cgroup
                hostPath:
                  path: %s
`, base, agentRepo, tag, cgroupDir)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// documented returns the kubectl command lines of the first sh block after the
// heading of docs/kubernetes.md, with deploy/kubernetes replaced by the overlay:
// the test runs what the docs tell users to run.
func documented(t *testing.T, root, heading, overlayDir string) [][]string {
	t.Helper()
	f, err := os.Open(filepath.Join(root, "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmds [][]string
	inSection, inBlock := false, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case l == heading:
			inSection = true
		case inSection && !inBlock && l == "```sh":
			inBlock = true
		case inBlock && l == "```":
			if len(cmds) == 0 {
				t.Fatalf("docs/kubernetes.md %q: no kubectl command in its first sh block", heading)
			}
			return cmds
		case inBlock && strings.HasPrefix(l, "kubectl "):
			args := strings.Fields(strings.ReplaceAll(l, "deploy/kubernetes", overlayDir))
			cmds = append(cmds, args[1:])
		}
	}
	t.Fatalf("docs/kubernetes.md: no sh block under %q", heading)
	return nil
}
