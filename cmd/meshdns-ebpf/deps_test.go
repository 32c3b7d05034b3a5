package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The Kubernetes API packages the agent reads (internal/kubeclient's
// scheme). Every other k8s.io/api package registers types the agent never
// decodes, and its code and init are paid in every mode on every node.
var allowedKubeAPI = []string{
	"k8s.io/api/apps/v1",
	"k8s.io/api/core/v1",
	"k8s.io/api/discovery/v1",
}

// The agent links neither client-go's clientset nor its all-groups scheme
// (k8s.io/client-go/kubernetes/...), and of k8s.io/api only the groups it
// reads. The graph is the one `go build ./cmd/meshdns-ebpf` links here
// (GOFLAGS and the build environment included).
func TestAgentLinksOnlyTheKubernetesAPIsItReads(t *testing.T) {
	graph, importers := testenv.ImportGraph(t)
	if !slices.Contains(graph, "k8s.io/client-go/rest") {
		t.Fatalf("the graph (%d packages) lacks k8s.io/client-go/rest: not the agent's", len(graph))
	}
	var bad []string
	for _, p := range graph {
		clientset := p == "k8s.io/client-go/kubernetes" || strings.HasPrefix(p, "k8s.io/client-go/kubernetes/")
		extraAPI := strings.HasPrefix(p, "k8s.io/api/") && !slices.Contains(allowedKubeAPI, p)
		if clientset || extraAPI {
			bad = append(bad, p+" (imported by "+strings.Join(importers[p], ", ")+")")
		}
	}
	if len(bad) > 0 {
		t.Errorf("the agent links %d packages it must not:\n  %s", len(bad), strings.Join(bad, "\n  "))
	}
	for _, p := range allowedKubeAPI {
		if !slices.Contains(graph, p) {
			t.Errorf("%s is no longer linked: drop it from allowedKubeAPI", p)
		}
	}
}
