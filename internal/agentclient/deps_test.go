package agentclient

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// The CLI's client reads what a running agent publishes (its state file,
// lock and admin endpoints, through internal/agentstate) and never links the
// agent itself: no resolver, name sources or handover of the daemon in the
// client's graph. The graph is the one `go build ./internal/agentclient`
// links here (GOFLAGS and the build environment included).
func TestClientDoesNotLinkTheAgent(t *testing.T) {
	const self = "github.com/meshdns/meshdns-ebpf/internal/agentclient"
	const forbidden = "github.com/meshdns/meshdns-ebpf/internal/agent"
	out, err := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}} {{join .Imports " "}}`, ".").Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("go list -deps: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list -deps: %v", err)
	}
	importers := map[string][]string{} // package -> the packages of the graph importing it
	var graph []string
	for line := range strings.Lines(strings.TrimSpace(string(out))) {
		fields := strings.Fields(line)
		graph = append(graph, fields[0])
		for _, imp := range fields[1:] {
			importers[imp] = append(importers[imp], fields[0])
		}
	}
	if !slices.Contains(graph, self) {
		t.Fatalf("the graph (%d packages) lacks %s: not the client's", len(graph), self)
	}
	for _, p := range graph {
		if p == forbidden || strings.HasPrefix(p, forbidden+"/") {
			t.Errorf("the client links %s (imported by %s)", p, strings.Join(importers[p], ", "))
		}
	}
}
