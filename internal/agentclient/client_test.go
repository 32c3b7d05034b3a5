package agentclient

import (
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// Cgroup paths as kubelet makes them, with either cgroup driver and every
// QoS class, name their pod; other cgroups do not.
func TestNamePods(t *testing.T) {
	pods := []kubesource.PodRef{
		{UID: "0f2a6b3c-1d4e-4f50-8a6b-7c8d9e0f1a2b", Namespace: "team-a", Name: "web-1"},
		{UID: "5b7e9d0c-2a3f-4e61-9b7c-8d9e0f1a2b3c", Namespace: "team-b", Name: "api-0"},
		{UID: "c61d2e3f4a5b6c7d8e9f0a1b2c3d4e5f", Namespace: "kube-system", Name: "etcd-node-a"}, // a static pod's mirror
	}
	tests := []struct{ path, uid, pod string }{
		{"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f2a6b3c_1d4e_4f50_8a6b_7c8d9e0f1a2b.slice/cri-containerd-4c1f2e3d4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0.scope",
			"0f2a6b3c-1d4e-4f50-8a6b-7c8d9e0f1a2b", "team-a/web-1"},
		{"kubepods/besteffort/pod5b7e9d0c-2a3f-4e61-9b7c-8d9e0f1a2b3c/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
			"5b7e9d0c-2a3f-4e61-9b7c-8d9e0f1a2b3c", "team-b/api-0"},
		{"kubepods.slice/kubepods-podc61d2e3f4a5b6c7d8e9f0a1b2c3d4e5f.slice/cri-containerd-aa.scope",
			"c61d2e3f4a5b6c7d8e9f0a1b2c3d4e5f", "kube-system/etcd-node-a"},
		{"kubepods/pod11111111-2222-3333-4444-555555555555/abc", "11111111-2222-3333-4444-555555555555", ""}, // not on this node
		{"system.slice/containerd.service", "", ""},
		{"kubepods.slice/kubepods-burstable.slice", "", ""},
		{"", "", ""},
	}
	s := &redirect.Stats{}
	for _, tt := range tests {
		if got := PodUID(tt.path); got != tt.uid {
			t.Errorf("PodUID(%q) = %q, want %q", tt.path, got, tt.uid)
		}
		s.Cgroups = append(s.Cgroups, redirect.CgroupStats{Path: tt.path})
	}
	NamePods(s, pods)
	for i, tt := range tests {
		if got := s.Cgroups[i].Pod; got != tt.pod {
			t.Errorf("pod of %q = %q, want %q", tt.path, got, tt.pod)
		}
	}
}

// `status` says when an optional source fails and is not waited for, and why.
func TestStatusShowsDegradedOptionalSource(t *testing.T) {
	var b strings.Builder
	err := writeSources(&b, []names.SourceStatus{
		{Name: "kubernetes", Priority: 80, Blocking: true, Synced: true, Objects: 3},
		{Name: "serviceentries", Priority: 40, Blocking: true, Optional: true, Errors: 4,
			FailingSince: time.Now().Add(-90 * time.Second), LastError: "serviceentries: serviceentries.networking.istio.io is forbidden"},
	})
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(b.String(), "\n")
	var se string
	for _, l := range lines {
		if strings.HasPrefix(l, "serviceentries") {
			se = l
		}
	}
	for _, want := range []string{"no (optional, failing: not waited for)", "down for 1m30s", "is forbidden"} {
		if !strings.Contains(se, want) {
			t.Errorf("status line %q lacks %q\n%s", se, want, b.String())
		}
	}
}
