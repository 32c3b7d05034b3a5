package main

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/dnsperf"
	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
)

// satRun fakes a saturation run: qps over 10 s with the given core use.
func satRun(qps, server, gen float64) run {
	return run{
		res:       dnsperf.Result{QPS: qps, RunTime: 10, Completed: uint64(qps * 10), Rcodes: map[string]uint64{"NOERROR": uint64(qps * 10)}},
		serverCPU: time.Duration(server * 10 * float64(time.Second)),
		genBusy:   gen,
	}
}

func TestSummarizeAndBound(t *testing.T) {
	for _, tc := range []struct {
		name    string
		runs    []run
		qps     float64
		bound   string
		genOnly bool
	}{
		{"server", []run{satRun(100, 0.99, 0.5), satRun(300, 0.98, 0.6), satRun(200, 0.97, 0.5)}, 200, "server", false},
		{"generator", []run{satRun(300e3, 0.6, 0.97), satRun(310e3, 0.62, 0.99)}, 305e3, "generator", true},
		{"both", []run{satRun(1, 0.95, 0.95)}, 1, "server+generator", false},
		{"neither", []run{satRun(1, 0.5, 0.5)}, 1, "neither (latency/-q)", false},
	} {
		s := summarize(&scenarioResult{sat: tc.runs})
		if !s.ok || s.qps != tc.qps || s.bound() != tc.bound || s.genBound() != tc.genOnly {
			t.Errorf("%s: qps %v bound %q genBound %v; want %v %q %v", tc.name, s.qps, s.bound(), s.genBound(), tc.qps, tc.bound, tc.genOnly)
		}
	}
	if s := summarize(nil); s.ok {
		t.Error("nil scenario summarized as ok")
	}
	// µs/query: 1 core for 10 s over 1e6 queries = 10 µs.
	if r := satRun(1e5, 1, 0); r.usPerQuery() != 10 || r.serverBusy() != 1 {
		t.Errorf("usPerQuery %v serverBusy %v", r.usPerQuery(), r.serverBusy())
	}
}

func TestQPSRatio(t *testing.T) {
	srv := func(q float64) summary { return summarize(&scenarioResult{sat: []run{satRun(q, 0.99, 0.5)}}) }
	gen := func(q float64) summary { return summarize(&scenarioResult{sat: []run{satRun(q, 0.5, 0.99)}}) }
	for _, tc := range []struct {
		name      string
		sub, peer summary
		want      string
	}{
		{"both server-bound", srv(250), srv(100), "2.50x"},
		{"peer gen-bound", srv(200), gen(100), "≤2.00x"},
		{"subject gen-bound", gen(300), srv(100), "≥3.00x"},
		{"both gen-bound", gen(300), gen(300), "~1.00x (both gen-bound: see CPU)"},
		{"missing", summary{}, srv(1), "-"},
	} {
		if got := qpsRatio(tc.sub, tc.peer); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestHelpers(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
	}{{"0-1", 2}, {"0", 1}, {"0-3,6,8-9", 7}, {"x", 0}, {"3-1", 0}} {
		if got := countCPUs(tc.in); got != tc.want {
			t.Errorf("countCPUs(%q) = %d, want %d", tc.in, got, tc.want)
		}
	}
	for _, tc := range []struct {
		v    float64
		want string
	}{{1234567.8, "1,234,568"}, {999, "999"}, {1000, "1,000"}, {0, "-"}} {
		if got := fmtQPS(tc.v); got != tc.want {
			t.Errorf("fmtQPS(%v) = %q, want %q", tc.v, got, tc.want)
		}
	}
	if m := median([]float64{3, 1, 2}); m != 2 {
		t.Errorf("median = %v", m)
	}
	if m := median([]float64{4, 1, 2, 3}); m != 2.5 {
		t.Errorf("median = %v", m)
	}
	if got := rcodeMix(map[string]uint64{"NXDOMAIN": 3, "NOERROR": 1}); got != "NOERROR 25%, NXDOMAIN 75%" {
		t.Errorf("rcodeMix = %q", got)
	}
}

func TestBuildTimeSources(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, log string
		want      time.Duration
		ok        bool
	}{
		{"text", "time=x level=INFO msg=\"name table loaded\" hosts=1000 skipped=0 exists=true duration=1.5ms\n", 1500 * time.Microsecond, true},
		{"micro", "level=INFO msg=\"name table loaded\" hosts=3 duration=812.3µs\n", 812300 * time.Nanosecond, true},
		{"json", `{"level":"INFO","msg":"name table loaded","hosts":5,"duration":2500000}` + "\n", 2500 * time.Microsecond, true},
		{"floor", "level=INFO msg=\"floor table loaded\" names=10 took=3ms\n", 3 * time.Millisecond, true},
		{"none", "level=INFO msg=serving\n", 0, false},
	} {
		p := filepath.Join(dir, tc.name)
		if err := os.WriteFile(p, []byte(tc.log), 0o644); err != nil {
			t.Fatal(err)
		}
		got, ok := logBuildTime(p)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: %v %v, want %v %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
	for _, tc := range []struct {
		name, body string
		want       time.Duration
	}{
		{"gauge", "# HELP x\nmeshdns_nametable_build_seconds 0.25\nmeshdns_dns_requests_total 5\n", 250 * time.Millisecond},
		{"histogram", "meshdns_nametable_load_duration_seconds_bucket{le=\"1\"} 2\nmeshdns_nametable_load_duration_seconds_sum 0.5\nmeshdns_nametable_load_duration_seconds_count 2\n", 250 * time.Millisecond},
		{"absent", "meshdns_nametable_hosts 1000\nmeshdns_nametable_last_reload_success_timestamp_seconds 1.7e9\n", 0},
	} {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, tc.body) }))
		got, _ := scrapeBuildTime(strings.TrimPrefix(srv.URL, "http://"))
		srv.Close()
		if got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// render must lead with the ratio table for meshdns and state missing parts.
func TestRender(t *testing.T) {
	cfg := config{scenarios: []string{"table"}, reps: 1, duration: time.Second, latQPS: 20000, latDuration: time.Second,
		tableSize: 1000, clients: 4, outstanding: 200, serverCPU: 1, genCPU: 0, scale: true, datapath: true,
		coreDNS: "/nonexistent/coredns", unboundBin: "/nonexistent/unbound", dnsmasq: "/nonexistent/dnsmasq"}
	fixed := satRun(20000, 0.2, 0.2)
	fixed.res.Latencies = []float64{40e-6, 50e-6, 90e-6}
	// Three fixed-rate runs: the report uses the one with the median p99.
	var reps []run
	for _, worst := range []float64{300e-6, 90e-6, 60e-6} {
		r := satRun(20000, 0.2, 0.2)
		r.res.Latencies = []float64{40e-6, 50e-6, worst}
		reps = append(reps, r)
	}
	b := &bench{cfg: cfg, tab: meshdata.NewTable(10, 0), started: time.Now(), datapath: datapathReport{skipped: "needs the agent"}}
	b.results = []peerResult{
		{peer: peer{name: "meshdns"}, scen: map[string]*scenarioResult{"table": {name: "table", sat: []run{satRun(300e3, 0.99, 0.8)}, fixedRuns: reps, fixed: medianRun(reps, p99)}}},
		{peer: peer{name: "coredns-prod"}, scen: map[string]*scenarioResult{"table": {name: "table", sat: []run{satRun(100e3, 0.99, 0.5)}, fixed: &fixed}}},
		{peer: peer{name: "floor"}, skipped: "not built"},
	}
	slow := fixed
	slow.res.Latencies = []float64{40e-6, 50e-6, 1500e-6}
	b.scale = []scaleResult{
		{server: "meshdns", size: 100000, ready: 800 * time.Millisecond, steady: &fixed,
			partial: reloadRun{run: &fixed, mem: procstat.Mem{HWM: 140 << 20}, lat: []time.Duration{200 * time.Millisecond}},
			full:    reloadRun{run: &slow, mem: procstat.Mem{HWM: 190 << 20}, lat: []time.Duration{900 * time.Millisecond}}},
		{server: "floor", size: 100000, ready: 1500 * time.Millisecond, steady: &fixed,
			partial: reloadRun{run: &fixed}, full: reloadRun{run: &fixed}},
	}
	noisy := satRun(100e3, 0.5, 0.5)
	noisy.serverCore, noisy.genCore = 0.9, 0.5
	b.results[1].scen["fwd"] = &scenarioResult{name: "fwd", sat: []run{noisy}}
	b.cfg.scenarios = []string{"table", "fwd"}
	out := b.render()
	wantLines(t, out,
		"## Ratios: meshdns vs each peer",
		"| coredns-prod | 3.00x | - | 1.00x / - | 100,000 / 100,000 | srv/neither |",
		"| floor | - | - | - | - | skipped: not built |",
		">= 2.5x coredns-prod QPS: PASS (3.00x)",
		"in-table p99 @20000 QPS <= 100 µs: PASS (90 µs, the median of 3 runs)",
		"| 50 / 90 | 300, 90, 60 |",
		"100k services built in < 1 s: PASS",
		"| meshdns | 100000 | ready 800ms after exec (no build-time metric) | 0.0 MB | 140.0 / 190.0 MB | 50 / 90 | 50 / 90 / 90 | 50 / 1500 / 1500 | 0 | 200ms | 900ms |",
		"- built in < 1 s: PASS (ready 800ms after exec (no build-time metric))",
		"- VmHWM through the load and the 1% rewrites <= 150 MB: PASS (140.0 MB)",
		"- query p99 @20000 QPS during the 1% rewrites <= 1 ms: PASS (90 µs; the floor's during its own reloads of the same table: 90 µs)",
		"- VmHWM through the load and the full rewrites <= 150 MB: **FAIL** (190.0 MB)",
		"- query p99 @20000 QPS during the full rewrites <= 1 ms: **FAIL** (1500 µs; the floor's during its own reloads of the same table: 90 µs)",
		"datapath targets: NOT MEASURED (needs the agent)",
		"NOISY: coredns-prod / cached forward: other work used 40% of a core",
	)
	if strings.Index(out, "## Ratios") > strings.Index(out, "## Saturation") {
		t.Error("ratios do not lead")
	}
	if n := strings.Count(out, "100k services built"); n != 1 {
		t.Errorf("100k target judged %d times, want once (meshdns only)", n)
	}
}

func TestKeepManual(t *testing.T) {
	manual := manualMarker + "\n\n## What was tried\n\n- pre-packed answers: +40%\n"
	for _, tc := range []struct{ name, old, want string }{
		{"first run", "", "# new\n\n" + manualMarker + "\n\n## What was tried (optimisation log)\n\n_Nothing yet._\n"},
		{"kept", "# old table\n\n" + manual, "# new\n\n" + manual},
	} {
		if got := keepManual("# new\n", tc.old); got != tc.want {
			t.Errorf("%s:\n%q\nwant\n%q", tc.name, got, tc.want)
		}
	}
}

// fixedRun fakes a fixed-rate run at 20k QPS for 1 s: its latencies (µs) and
// the server's µs of CPU per query.
func fixedRun(usq float64, latUS ...float64) run {
	r := satRun(20000, usq*20000/1e6, 0.2)
	for _, l := range latUS {
		r.res.Latencies = append(r.res.Latencies, l*1e-6)
	}
	r.res.RunTime = 1
	return r
}

func TestRenderTargets14(t *testing.T) {
	cfg := config{scenarios: []string{"table", "fwd"}, latQPS: 20000, echoBin: "/bin/echo-server"}
	b := &bench{cfg: cfg, tab: meshdata.NewTable(10, 0), started: time.Now(), datapath: datapathReport{skipped: "needs the agent"}}
	mesh := map[string]*scenarioResult{
		// in-table: cheaper than unbound, faster at saturation, one run over 100 µs.
		"table": {sat: []run{satRun(150e3, 0.8, 0.99)},
			// CPU/query is the median over the runs (12), not the median-p99 run's (10).
			fixedRuns: []run{fixedRun(10, 40, 90), fixedRun(30, 40, 120), fixedRun(12, 40, 80)},
			echoRuns:  []run{fixedRun(5, 40, 95), fixedRun(5, 40, 110), fixedRun(5, 40, 70)}},
		// cached forward: dearer than unbound, generator-bound below its QPS
		// but cheaper per query at saturation; every run under 100 µs.
		"fwd": {sat: []run{satRun(120e3, 0.6, 0.99)},
			fixedRuns: []run{fixedRun(16, 40, 90), fixedRun(16, 40, 99), fixedRun(16, 40, 100)}},
	}
	for _, sr := range mesh {
		sr.fixed = medianRun(sr.fixedRuns, p99)
	}
	fu := fixedRun(15, 40, 90)
	unbound := map[string]*scenarioResult{
		"table": {sat: []run{satRun(130e3, 0.95, 0.95)}, fixed: &fu},
		"fwd":   {sat: []run{satRun(130e3, 0.95, 0.95)}, fixed: &fu},
	}
	b.results = []peerResult{{peer: peer{name: "meshdns"}, scen: mesh}, {peer: peer{name: "unbound"}, scen: unbound}}
	out := b.render()
	wantLines(t, out,
		"### Targets: resolver core",
		"- in-table: CPU/query @20000 QPS <= unbound's: PASS (12.0 vs 15.0 µs, 0.80x)",
		"- cached forward: CPU/query @20000 QPS <= unbound's: **FAIL** (16.0 vs 15.0 µs, 1.07x)",
		"- CPU/query @20000 QPS <= dnsmasq's: NOT MEASURED (dnsmasq not run)",
		"- in-table: saturation QPS >= unbound's: PASS (150,000 vs 130,000)",
		// satRun(120e3, 0.6, ..): 0.6 core / 120k QPS = 5 µs; unbound 0.95 / 130k = 7.3 µs.
		"- cached forward: saturation QPS >= unbound's: PASS by CPU/query at saturation, meshdns generator-bound (5.0 vs 7.3 µs; QPS 120,000 vs 130,000)",
		"- in-table p99 @20000 QPS <= 100 µs in every run: **FAIL** (90, 120, 80 µs; the do-nothing echo server right after each: 95, 110, 70 µs)",
		"- cached forward p99 @20000 QPS <= 100 µs in every run: PASS (90, 99, 100 µs; the machine floor was not measured)",
		"## Machine floor: meshdns beside a server that does nothing",
		"| in-table | 40, 40, 40 | 90, 120, 80 | 40, 40, 40 | 95, 110, 70 | 12.0 / 5.0 |",
	)
	if strings.Contains(out, "| cached forward | 40, 40, 40 |") {
		t.Error("machine-floor row for a scenario without echo runs")
	}
}

// wantLines reports each of wants that the rendered report lacks.
func wantLines(t *testing.T, out string, wants ...string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(out, want) {
			t.Errorf("render lacks %q:\n%s", want, out)
		}
	}
}

// The Kubernetes section (bench/kube's output) goes right above the
// hand-written part, in place of the one an earlier run put there: a run of
// bench/kube alone (BENCH_KUBE_ONLY=1) replaces it, never adds a second.
func TestWithKubeSection(t *testing.T) {
	manual := manualMarker + "\n\n## What was tried\n\n- x\n"
	kube := func(v string) string {
		return kubeHeading + "\n\n| meshdns | " + v + " |\n\n## Mesh: ServiceEntries and two clusters\n\n| " + v + " |\n"
	}
	for _, tc := range []struct{ name, old, want string }{
		{"none yet", "# gen\n\n## Scale\n\n" + manual, "# gen\n\n## Scale\n\n" + kube("new") + "\n" + manual},
		{"replaced", "# gen\n\n## Scale\n\n" + kube("old") + "\n" + manual, "# gen\n\n## Scale\n\n" + kube("new") + "\n" + manual},
		{"two from before", "# gen\n\n" + kube("old") + "\n" + kube("older") + "\n" + manual, "# gen\n\n" + kube("new") + "\n" + manual},
		{"no hand-written part", "# gen\n", "# gen\n\n" + kube("new") + "\n" + manualMarker + "\n\n## What was tried (optimisation log)\n\n_Nothing yet._\n"},
	} {
		if got := withKubeSection(tc.old, kube("new")); got != tc.want {
			t.Errorf("%s:\n%s\nwant\n%s", tc.name, got, tc.want)
		}
	}
}
