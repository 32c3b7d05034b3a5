package testenv

import (
	"os/exec"
	"strings"
	"testing"
)

// ImportGraph lists the packages that `go build` of the package in the
// current directory links (GOFLAGS and the build environment included), in
// `go list -deps` order, and for each the packages of the graph that import
// it: what a test of a binary's or a client's dependencies reads.
func ImportGraph(t testing.TB) (graph []string, importers map[string][]string) {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}} {{join .Imports " "}}`, ".").Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("go list -deps: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list -deps: %v", err)
	}
	importers = map[string][]string{}
	for line := range strings.Lines(strings.TrimSpace(string(out))) {
		fields := strings.Fields(line)
		graph = append(graph, fields[0])
		for _, imp := range fields[1:] {
			importers[imp] = append(importers[imp], fields[0])
		}
	}
	return graph, importers
}
