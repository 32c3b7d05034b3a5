package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// docRoots are the top-level directories whose subdirectories
// docs/design.md's layout must list, one by one.
var docRoots = []string{"internal", "cmd", "tools", "test"}

// TestDesignLayoutListsEveryDirectory: every directory under internal/,
// cmd/, tools/ and test/ (testdata aside) is named in the Layout section of
// docs/design.md, so a new package cannot go undocumented silently.
func TestDesignLayoutListsEveryDirectory(t *testing.T) {
	root := repoRoot()
	listed := layoutPaths(t, filepath.Join(root, "docs", "design.md"))
	for _, top := range docRoots {
		err := filepath.WalkDir(filepath.Join(root, top), func(path string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return err
			}
			rel, _ := filepath.Rel(root, path)
			switch {
			case d.Name() == "testdata":
				return filepath.SkipDir
			case rel == top:
				return nil
			}
			if !listed[filepath.ToSlash(rel)+"/"] {
				t.Errorf("docs/design.md's Layout does not list %s/", rel)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

var backticked = regexp.MustCompile("`([^`]+)`")

// layoutPaths returns the directories the Layout table names: the paths of
// each row's first cell, and the subdirectories its cells name relative to
// them (`filesource/` in the row of `internal/names/`).
func layoutPaths(t *testing.T, design string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(design)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start := strings.Index(doc, "\n## Layout\n")
	if start < 0 {
		t.Fatal("docs/design.md has no Layout section")
	}
	section := doc[start+1:]
	if end := strings.Index(section[1:], "\n## "); end >= 0 {
		section = section[:end+1]
	}
	listed := map[string]bool{}
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, " | ")
		if !strings.HasPrefix(line, "| `") || len(cells) < 2 {
			continue
		}
		var bases []string
		for _, m := range backticked.FindAllStringSubmatch(cells[0], -1) {
			if strings.HasSuffix(m[1], "/") && strings.Contains(m[1], "/") && isRooted(m[1]) {
				bases = append(bases, m[1])
				listed[m[1]] = true
			}
		}
		for _, m := range backticked.FindAllStringSubmatch(line, -1) {
			if p := m[1]; strings.HasSuffix(p, "/") && !isRooted(p) {
				for _, base := range bases {
					listed[base+p] = true
				}
			}
		}
	}
	return listed
}

func isRooted(p string) bool {
	for _, top := range append([]string{"bpf", "deploy", "charts", "docs", "scripts", "bench", ".ci"}, docRoots...) {
		if strings.HasPrefix(p, top+"/") {
			return true
		}
	}
	return false
}
