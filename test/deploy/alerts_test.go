package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// runbookBase is where every alert's runbook_url points: a section of
// docs/kubernetes.md, anchor runbook-<alert, lowercase>.
const runbookBase = "https://github.com/meshdns/meshdns-ebpf/blob/main/docs/kubernetes.md#"

// trailingNumber is the number an expression ends with after > or < (what the
// chart's thresholds set).
var trailingNumber = regexp.MustCompile(`[<>]=?\s*(-?[0-9.eE+]+)\s*$`)

// Every alert has a `for:`, a runbook_url to its own section of docs/kubernetes.md
// (which exists), a row in its Alerts table, and a description that states its `for:`
// ("for 5m") and the number its expression ends with, each exactly once: the chart
// rewrites both when the values change them.
func TestAlertConventions(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	docs := string(b)
	alerts := alertRules(t, prometheusRule(t))
	names := make([]string, 0, len(alerts))
	for name := range alerts {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		r := alerts[name]
		forDur, _ := r["for"].(string)
		if forDur == "" {
			t.Errorf("%s: no for:", name)
		}
		ann, _ := r["annotations"].(map[string]any)
		desc, _ := ann["description"].(string)
		if want := runbookBase + "runbook-" + strings.ToLower(name); ann["runbook_url"] != want {
			t.Errorf("%s: runbook_url %v, want %s", name, ann["runbook_url"], want)
		}
		if !strings.Contains(docs, "\n#### Runbook: "+name+"\n") {
			t.Errorf("%s: docs/kubernetes.md has no section \"#### Runbook: %s\" (its runbook_url's anchor)", name, name)
		}
		if !regexp.MustCompile(`(?m)^\| ` + name + ` \|`).MatchString(docs) {
			t.Errorf("%s: no row in docs/kubernetes.md's Alerts table", name)
		}
		if n := len(regexp.MustCompile(`\bfor `+regexp.QuoteMeta(forDur)+`\b`).FindAllString(desc, -1)); forDur != "" && n != 1 {
			t.Errorf("%s: the description states \"for %s\" %d times, want once: %q", name, forDur, n, desc)
		}
		if m := trailingNumber.FindStringSubmatch(r["expr"].(string)); m != nil {
			re := regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(m[1]) + `([^0-9.]|$)`)
			if n := len(re.FindAllString(desc, -1)); n != 1 {
				t.Errorf("%s: the description states its threshold %s %d times, want once: %q", name, m[1], n, desc)
			}
		}
		for _, l := range []string{"namespace", "pod"} {
			if strings.Contains(desc+fmt.Sprint(ann["summary"]), "$labels."+l+" ") && strings.Contains(r["expr"].(string), "top_workload") {
				t.Errorf("%s: names the target label %s, which a Kubernetes scrape sets to the agent's pod", name, l)
			}
		}
	}
	t.Logf("%d alerts: each with for, runbook section, table row, and a description that states its for and threshold", len(names))
}
