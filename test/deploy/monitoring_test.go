package deploy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The monitoring pack: components/prometheus-rules (alerts and their promtool
// tests) and components/grafana-dashboard.
func rulesDir() string { return filepath.Join(manifestsDir(), "components", "prometheus-rules") }
func dashboardFile() string {
	return filepath.Join(manifestsDir(), "components", "grafana-dashboard", "meshdns-ebpf.json")
}

// prometheusRule decodes components/prometheus-rules/prometheusrule.yaml.
func prometheusRule(t *testing.T) *unstructured.Unstructured {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(rulesDir(), "prometheusrule.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decodeStrict(b)
	if err != nil || len(objs) != 1 {
		t.Fatalf("prometheusrule.yaml: %v (%d objects)", err, len(objs))
	}
	return objs[0].obj.(*unstructured.Unstructured)
}

// writeRuleFile writes a PrometheusRule's spec as a Prometheus rule file
// (`groups:`), without annotations when strip is set.
func writeRuleFile(t *testing.T, pr *unstructured.Unstructured, path string, strip bool) {
	t.Helper()
	spec, _, _ := unstructured.NestedMap(pr.Object, "spec")
	if strip {
		for _, g := range spec["groups"].([]any) {
			for _, r := range g.(map[string]any)["rules"].([]any) {
				delete(r.(map[string]any), "annotations")
			}
		}
	}
	b, err := yaml.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// promtool test files: which alerts each case expects to fire or stay quiet.
type ruleTestFile struct {
	RuleFiles []string `json:"rule_files"`
	Tests     []struct {
		Name          string `json:"name"`
		AlertRuleTest []struct {
			Alertname string `json:"alertname"`
			ExpAlerts []any  `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

// Every alert passes `promtool check rules` (as shipped, and as the chart renders it
// with other thresholds), and its promtool unit tests, which show each one firing and
// not firing on synthetic series.
func TestAlertRules(t *testing.T) {
	pr := prometheusRule(t)
	dir := t.TempDir()
	full := filepath.Join(dir, "full.yaml")
	writeRuleFile(t, pr, full, false)
	if out, err := runTool(t, nil, "promtool", "check", "rules", full); err != nil {
		t.Fatalf("promtool check rules: %v", err)
	} else {
		t.Logf("promtool check rules: %s", strings.TrimSpace(string(out)))
	}

	// Unit tests: rules.yaml (labels only) and annotated-rules.yaml (with their
	// annotations, for the tests that check what an alert says) beside a copy of
	// each test file.
	writeRuleFile(t, pr, filepath.Join(dir, "rules.yaml"), true)
	writeRuleFile(t, pr, filepath.Join(dir, "annotated-rules.yaml"), false)
	tests, _ := filepath.Glob(filepath.Join(rulesDir(), "tests", "*.yaml"))
	if len(tests) == 0 {
		t.Fatal("no promtool tests in components/prometheus-rules/tests")
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tf := range tests {
		b, err := os.ReadFile(tf)
		if err != nil {
			t.Fatal(err)
		}
		var parsed ruleTestFile
		if err := yaml.UnmarshalStrict(b, &parsed); err != nil {
			// promtool's format has more fields than this test reads.
			if err := yaml.Unmarshal(b, &parsed); err != nil {
				t.Fatalf("%s: %v", tf, err)
			}
		}
		if !slices.Equal(parsed.RuleFiles, []string{"rules.yaml"}) && !slices.Equal(parsed.RuleFiles, []string{"annotated-rules.yaml"}) {
			t.Fatalf("%s: rule_files %v, want [rules.yaml] or [annotated-rules.yaml] (the test writes them)", tf, parsed.RuleFiles)
		}
		for _, c := range parsed.Tests {
			for _, a := range c.AlertRuleTest {
				if len(a.ExpAlerts) > 0 {
					fires[a.Alertname] = true
				} else {
					quiet[a.Alertname] = true
				}
			}
		}
		cp := filepath.Join(dir, filepath.Base(tf))
		if err := os.WriteFile(cp, b, 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := runTool(t, nil, "promtool", "test", "rules", cp)
		if err != nil {
			t.Fatalf("promtool test rules %s: %v", filepath.Base(tf), err)
		}
		t.Logf("promtool test rules %s: %s", filepath.Base(tf), strings.TrimSpace(string(out)))
	}
	alerts := alertRules(t, pr)
	for name := range alerts {
		if !fires[name] || !quiet[name] {
			t.Errorf("alert %s: promtool tests where it fires: %v, where it does not: %v (both are required)", name, fires[name], quiet[name])
		}
	}
	for name := range fires {
		if alerts[name] == nil {
			t.Errorf("the promtool tests name alert %s, which the rules lack", name)
		}
	}
	t.Logf("%d alerts, each tested firing and quiet", len(alerts))

	// The chart's thresholds still give valid rules.
	out, err := helmTemplate(t, "prometheusRule: {enabled: true, thresholds: {MeshDNSNameSourceStale: 900, MeshDNSOverloadShedding: 0.05, MeshDNSCacheAtCap: 0.95}, for: {MeshDNSAgentNotReady: 15m}}")
	if err != nil {
		t.Fatal(err)
	}
	objs, err := decodeStrict(out)
	if err != nil {
		t.Fatal(err)
	}
	rendered := filepath.Join(dir, "chart.yaml")
	writeRuleFile(t, find[*unstructured.Unstructured](t, objs, "PrometheusRule", "meshdns-ebpf"), rendered, false)
	if _, err := runTool(t, nil, "promtool", "check", "rules", rendered); err != nil {
		t.Fatalf("promtool check rules on the chart's rules with other thresholds: %v", err)
	}
}

// monitoringExprs are the PromQL expressions of the alerts and the dashboard (its
// panels' targets and its variables' label_values queries), each with where it is.
func monitoringExprs(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	for name, r := range alertRules(t, prometheusRule(t)) {
		out["alert "+name] = r["expr"].(string)
	}
	b, err := os.ReadFile(dashboardFile())
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("the dashboard is not valid JSON: %v", err)
	}
	// Grafana's variables, as a query would get them.
	vars := strings.NewReplacer("$__rate_interval", "5m", "${instance}", ".*", "$instance", ".*",
		"${cluster}", ".*", "$cluster", ".*", "${node}", ".*", "$node", ".*")
	for _, p := range dash.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("dashboard panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			out[fmt.Sprintf("panel %q %s", p.Title, tg.RefID)] = vars.Replace(tg.Expr)
		}
	}
	labelValues := regexp.MustCompile(`^label_values\((.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$`)
	for _, v := range dash.Templating.List {
		if v.Definition == "" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Errorf("dashboard variable %s: query %q is not label_values(EXPR, LABEL)", v.Name, v.Definition)
			continue
		}
		out["variable "+v.Name] = vars.Replace(m[1])
	}
	return out
}

// Every PromQL expression of the alerts and the dashboard parses with Prometheus'
// parser, and every metric it names is on the /metrics of a live agent: eBPF mode on
// a test cgroup (the datapath's metrics exist only there) with a names file.
func TestMonitoringMetricsExist(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "setpriv")
	exprs := monitoringExprs(t)
	keys := make([]string, 0, len(exprs))
	list := make([]string, 0, len(exprs))
	for k := range exprs {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		list = append(list, exprs[k])
	}
	in, _ := json.Marshal(list)
	out, err := runTool(t, in, "promql-metrics")
	if err != nil {
		t.Fatal(err)
	}
	var parsed []struct {
		Metrics []string `json:"metrics"`
		Error   string   `json:"error"`
	}
	if err := json.Unmarshal(out, &parsed); err != nil || len(parsed) != len(list) {
		t.Fatalf("promql-metrics output (%v): %s", err, out)
	}
	uses := map[string][]string{} // metric -> where
	for i, p := range parsed {
		if p.Error != "" {
			t.Errorf("%s: %q does not parse: %s", keys[i], list[i], p.Error)
		}
		if len(p.Metrics) == 0 && p.Error == "" {
			t.Errorf("%s: %q names no metric", keys[i], list[i])
		}
		for _, m := range p.Metrics {
			uses[m] = append(uses[m], keys[i])
		}
	}

	have := liveAgentMetrics(t)
	var missing []string
	for m, where := range uses {
		if !have[m] && externalMetrics[m] == "" {
			missing = append(missing, fmt.Sprintf("%s (used by %s)", m, strings.Join(where, "; ")))
		}
	}
	slices.Sort(missing)
	if len(missing) > 0 {
		t.Fatalf("metrics the monitoring pack uses that a live agent does not export:\n%s", strings.Join(missing, "\n"))
	}
	t.Logf("%d expressions, %d metrics, all on a live agent's /metrics", len(list), len(uses))
}

// externalMetrics are the metrics the monitoring pack uses that the agent does not
// export, with where they come from (docs/kubernetes.md#alerts says what each needs).
var externalMetrics = map[string]string{
	"up": "Prometheus, for every target",
	"kube_daemonset_status_desired_number_scheduled": "kube-state-metrics",
	"kube_daemonset_status_number_available":         "kube-state-metrics",
}

// liveAgentMetrics starts an agent in eBPF mode (own netns, cgroup and bpffs; a fake
// upstream; a names file) and returns the metric names of its /metrics.
func liveAgentMetrics(t *testing.T) map[string]bool {
	t.Helper()
	ns := testenv.NewNetns(t, "mdd-mon")
	cg := testenv.NewCgroup(t)
	bpffs := filepath.Join(testenv.NewBPFFS(t), "meshdns")
	ns.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	testenv.StartFakeDNS(t, ns, "169.254.53.1:53", nil)
	names := filepath.Join(t.TempDir(), "names.yaml")
	if err := os.WriteFile(names, []byte("table:\n  web.example.internal: {ips: [\"192.0.2.10\"]}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// An egress policy selecting a cgroup of the test: the egress series exist.
	egress := filepath.Join(t.TempDir(), "egress.yaml")
	clients := cg.Child(t, "clients")
	if err := os.WriteFile(egress, []byte("policies:\n  - name: clients\n    cgroup: "+clients.Path+"\n    egress:\n      - names: [web.example.internal]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const admin = "127.0.0.1:9153"
	cmd := testenv.Command(context.Background(), testenv.Proc{Netns: ns, Cgroup: cg, NetOnly: true, Caps: testenv.ModeCaps["ebpf"]},
		agenttest.Agent(t), "run", "--mode", "ebpf", "--cgroup", cg.Path, "--listen", "169.254.20.53:53",
		"--nameservers", "169.254.53.1", "--upstream", "169.254.53.1", "--names", names, "--admin", admin,
		"--bpffs", bpffs, "--state-dir", t.TempDir(), "--persist=false", "--memory-limit", "268435456",
		"--egress", "--egress-policy-file", egress)
	proc := agenttest.Start(t, cmd, agenttest.Options{Group: true})
	var have map[string]bool
	if !testenv.WaitFor(30*time.Second, func() bool {
		if proc.Exited() {
			return true
		}
		have = scrapeInNetns(ns, admin, "/metrics")
		return have["meshdns_build_info"] && have["meshdns_datapath_events_total"] && have["meshdns_egress_connects_total"]
	}) || len(have) == 0 {
		t.Fatalf("no metrics from the agent; log:\n%s", proc.Log.String())
	}
	return have
}

// scrapeInNetns GETs path from addr inside ns and returns the sample names it
// exposes. The connection is dialled on the thread in ns (http.Transport would
// dial from another goroutine, outside it).
func scrapeInNetns(ns *testenv.Netns, addr, path string) map[string]bool {
	names := map[string]bool{}
	_ = ns.Do(func() error {
		conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
		req.Close = true
		if err := req.Write(conn); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if line == "" || line[0] == '#' {
				continue
			}
			if i := strings.IndexAny(line, "{ "); i > 0 {
				names[line[:i]] = true
			}
		}
		return sc.Err()
	})
	return names
}
