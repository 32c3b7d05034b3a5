package kubesource_test

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// TestPodsOfThisNodeWithLabelsAndChanges: the source lists this node's Pods
// (not another node's) with their labels, and tells OnPods watchers of every
// change, so an egress policy selects a new pod without waiting for a resync.
func TestPodsOfThisNodeWithLabelsAndChanges(t *testing.T) {
	cp := kubetest.Start(t, kubetest.Options{})
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	src, err := kubesource.New(kubesource.Config{Name: "kubernetes", Rest: cp.RESTConfig(t, kubetest.Admin), NodeName: "node-a", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	var changes atomic.Int64
	src.OnPods(func() { changes.Add(1) })
	store, err := names.New(names.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Add(src, names.SourceOptions{Priority: names.PriorityKubernetes}); err != nil {
		t.Fatal(err)
	}
	if err := store.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	cp.EnsureNamespace(t, "shop")
	cp.CreatePod(t, kubetest.Pod{Namespace: "shop", Name: "web", Node: "node-a", Labels: map[string]string{"app": "web"}, IPs: []string{"10.1.0.5"}})
	cp.CreatePod(t, kubetest.Pod{Namespace: "shop", Name: "elsewhere", Node: "node-b", Labels: map[string]string{"app": "web"}, IPs: []string{"10.1.1.5"}})
	var pods []kubesource.PodRef
	if !testenv.WaitFor(20*time.Second, func() bool { pods = src.Pods(); return len(pods) == 1 && changes.Load() > 0 }) {
		t.Fatalf("pods %+v, %d changes told: want shop/web of this node, and its change told", pods, changes.Load())
	}
	if p := pods[0]; p.Namespace != "shop" || p.Name != "web" || p.Labels["app"] != "web" || p.UID == "" {
		t.Errorf("pod %+v: want shop/web with its UID and labels", p)
	}
	before := changes.Load()
	cp.DeletePod(t, "shop", "web")
	if !testenv.WaitFor(20*time.Second, func() bool {
		return changes.Load() > before && !slices.ContainsFunc(src.Pods(), func(p kubesource.PodRef) bool { return p.Name == "web" })
	}) {
		t.Errorf("the deleted pod: pods %+v, %d changes told after it (want more than %d)", src.Pods(), changes.Load(), before)
	}
}
