package agentclient

import (
	"slices"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The CLI's client reads what a running agent publishes (its state file,
// lock and admin endpoints, through internal/agentstate) and never links the
// agent itself: no resolver, name sources or handover of the daemon in the
// client's graph. The graph is the one `go build ./internal/agentclient`
// links here (GOFLAGS and the build environment included).
func TestClientDoesNotLinkTheAgent(t *testing.T) {
	const self = "github.com/meshdns/meshdns-ebpf/internal/agentclient"
	const forbidden = "github.com/meshdns/meshdns-ebpf/internal/agent"
	graph, importers := testenv.ImportGraph(t)
	if !slices.Contains(graph, self) {
		t.Fatalf("the graph (%d packages) lacks %s: not the client's", len(graph), self)
	}
	for _, p := range graph {
		if p == forbidden || strings.HasPrefix(p, forbidden+"/") {
			t.Errorf("the client links %s (imported by %s)", p, strings.Join(importers[p], ", "))
		}
	}
}
