//go:build linux

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
)

// Lookup latency as users see it: whole getaddrinfo-style lookups of external names
// with a pod's ndots:5 search list (bench/lookup: each try sends A and AAAA in
// parallel and waits for both; the lookup ends at the first try with addresses),
// through the eBPF datapath, from the captured cgroup. The agent's names file maps the
// client's address to the first namespace, so a lookup with that namespace's search
// list is the client's real one (autopath for external names answers its first try);
// the same lookups with another namespace's search list stand for a client whose
// search path the agent does not know (no autopath: three NXDOMAIN tries, then the
// name). Cold = each name for the first time (upstream miss); warm = the same names
// again (cached). CoreDNS's autopath needs its kubernetes plugin with `pods verified`,
// i.e. a Kubernetes API server, which this benchmark does not run.

const (
	lookupNames  = 300
	lookupRounds = 5 // warm rounds, the variants alternating
	lookupPasses = 2 // passes over the names per warm round
)

type lookupResult struct {
	Lookups, Failed, Queries int
	MeanUS, P50US, P99US     float64
	QueriesPerLookup         float64
}

type lookupRow struct {
	label      string
	cold, warm lookupResult   // warm: the round with the median p50 (medianRun)
	rounds     []lookupResult // every warm round, in order
	err        string
}

type lookupReport struct {
	skipped string
	rows    []lookupRow // [0] autopath (known client), [1] no autopath
}

func (b *bench) runLookups(ctx context.Context, env *dpEnv, port, fakePort int, resolv string) lookupReport {
	if b.cfg.lookupBin == "" {
		return lookupReport{skipped: "no -lookup binary (bench/run.sh builds it)"}
	}
	nss := b.tab.Namespaces()
	if len(nss) < 2 {
		return lookupReport{skipped: "the table has fewer than two namespaces"}
	}
	own, other := nss[0], nss[1]
	names, err := b.lookupTable(own)
	if err != nil {
		return lookupReport{skipped: err.Error()}
	}
	srv, err := b.startLookupAgent(ctx, env, port, fakePort, resolv, names)
	if err != nil {
		return lookupReport{skipped: err.Error()}
	}
	defer srv.stop()

	rep := lookupReport{rows: []lookupRow{
		{label: fmt.Sprintf("autopath (client known: search %s.svc...)", own)},
		{label: fmt.Sprintf("no autopath (search path unknown: %s.svc...)", other)},
	}}
	runs := lookupRuns{b: b, ctx: ctx, env: env,
		searches: []string{strings.Join(meshdata.SearchList(own), ","), strings.Join(meshdata.SearchList(other), ",")},
		files:    make([]string, len(rep.rows))}
	runs.cold(&rep)
	runs.warm(&rep)
	for i := range rep.rows {
		r := &rep.rows[i]
		if r.err != "" {
			continue
		}
		r.warm = *medianRun(r.rounds, func(x *lookupResult) float64 { return x.P50US })
		fmt.Fprintf(os.Stderr, "  lookup %-50s cold mean %.0f µs (%.1f queries)  warm median round: mean %.0f µs p50 %.0f µs p99 %.0f µs (%.1f queries)\n",
			r.label, r.cold.MeanUS, r.cold.QueriesPerLookup, r.warm.MeanUS, r.warm.P50US, r.warm.P99US, r.warm.QueriesPerLookup)
	}
	return rep
}

// lookupTable writes the table plus the client map (the captured client
// reaches the agent from the listen address's side of loopback, in
// namespace own) and returns its path.
func (b *bench) lookupTable(own string) (string, error) {
	var tab map[string]any
	nt, err := b.tab.NameTableJSON()
	if err == nil {
		err = json.Unmarshal(nt, &tab)
	}
	if err != nil {
		return "", err
	}
	tab["clients"] = map[string]string{dpListenIP: own}
	if nt, err = json.Marshal(tab); err != nil {
		return "", err
	}
	names := b.path("nametable-clients.json")
	return names, os.WriteFile(names, nt, 0o644)
}

// startLookupAgent starts the agent in eBPF mode on the table names and
// waits until it answers.
func (b *bench) startLookupAgent(ctx context.Context, env *dpEnv, port, fakePort int, resolv, names string) (*proc, error) {
	args := []string{b.cfg.meshBin, "run", "--mode", "ebpf",
		"--listen", fmt.Sprintf("%s:%d", dpListenIP, port),
		"--upstream", fmt.Sprintf("%s:%d", upstreamIP, fakePort),
		"--names", names,
		"--admin", fmt.Sprintf("127.0.0.1:%d", b.cfg.basePort+offMeshAdmin),
		"--resolv-conf", resolv,
		"--state-dir", filepath.Join(env.dir, "state-lookup"),
		"--cgroup", env.cgroup, "--nameservers", dpNameserver, "--bpffs", filepath.Join(env.bpffs, "meshdns")}
	args = append(args, strings.Fields(b.cfg.meshArgs)...)
	srv, err := start("dp-lookup", b.cfg.serverCPU, append(env.nsPrefix(), args...), nil, b.logDir)
	if err != nil {
		return nil, err
	}
	svc := b.tab.Services[0]
	deadline := time.Now().Add(30 * time.Second)
	for env.digIn(dpListenIP, port, svc.FQDN()) != svc.IP.String() {
		if srv.exited() || time.Now().After(deadline) || ctx.Err() != nil {
			srv.stop()
			return nil, fmt.Errorf("agent not answering; see %s", srv.log.Name())
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // first heartbeat/ready before capture is judged
	return srv, nil
}

// lookupRuns runs the lookup timer for each variant (row) of a report.
type lookupRuns struct {
	b        *bench
	ctx      context.Context
	env      *dpEnv
	searches []string // per row
	files    []string // per row: its names
}

// run runs the lookup timer over row i's names passes times.
func (l lookupRuns) run(i, passes int) (lookupResult, error) {
	argv := append(l.env.clientPrefix(), l.b.cfg.lookupBin, "-server", dpNameserver+":53", "-names", l.files[i],
		"-search", l.searches[i], "-ndots", "5", "-passes", fmt.Sprint(passes))
	cmd := exec.CommandContext(l.ctx, "taskset", append([]string{"-c", fmt.Sprint(l.b.cfg.genCPU)}, argv...)...)
	out, err := cmd.Output()
	var r lookupResult
	if err == nil {
		err = json.Unmarshal(out, &r)
	}
	if err == nil && r.Failed > 0 {
		err = fmt.Errorf("%d of %d lookups failed", r.Failed, r.Lookups)
	}
	return r, err
}

// cold writes each row's names (disjoint per variant, so each cold pass
// really misses) and runs one pass over them.
func (l lookupRuns) cold(rep *lookupReport) {
	for i := range rep.rows {
		var list strings.Builder
		for j := range lookupNames {
			fmt.Fprintf(&list, "l%d-%s\n", j, strings.TrimSuffix(meshdata.ExternalName(j+i*lookupNames), "."))
		}
		l.files[i] = l.b.path(fmt.Sprintf("lookup-names-%d.txt", i))
		if err := os.WriteFile(l.files[i], []byte(list.String()), 0o644); err != nil {
			rep.rows[i].err = err.Error()
			continue
		}
		var err error
		if rep.rows[i].cold, err = l.run(i, 1); err != nil {
			rep.rows[i].err = "cold: " + err.Error()
		}
	}
}

// warm runs the warm rounds: the two variants take turns, so a slow
// stretch of the machine lands on both; each round's ratio pairs the
// variants' runs of that round.
func (l lookupRuns) warm(rep *lookupReport) {
	for range lookupRounds {
		for i := range rep.rows {
			if rep.rows[i].err != "" {
				continue
			}
			r, err := l.run(i, lookupPasses)
			if err != nil {
				rep.rows[i].err = "warm: " + err.Error()
				continue
			}
			rep.rows[i].rounds = append(rep.rows[i].rounds, r)
		}
	}
}

// roundRatios are the autopath lookup's p50 and mean over the one without, warm, for
// each round (the two runs of a round ran back to back).
func (l lookupReport) roundRatios() (p50s, means []float64) {
	if l.skipped != "" || len(l.rows) != 2 || l.rows[0].err != "" || l.rows[1].err != "" {
		return nil, nil
	}
	a, b := l.rows[0].rounds, l.rows[1].rounds
	for i := range min(len(a), len(b)) {
		if b[i].P50US > 0 && b[i].MeanUS > 0 {
			p50s = append(p50s, a[i].P50US/b[i].P50US)
			means = append(means, a[i].MeanUS/b[i].MeanUS)
		}
	}
	return p50s, means
}

// verdict judges the median over rounds of the autopath lookup's p50 time over the
// one without (warm); the mean's median is shown beside it. The p50 decides: a busy
// machine's stalls land in the mean of either side.
func (l lookupReport) verdict() string {
	p50s, means := l.roundRatios()
	if len(p50s) == 0 {
		return "NOT MEASURED"
	}
	med := median(p50s)
	v := "FAIL"
	if med <= 0.3 {
		v = "PASS"
	}
	each := make([]string, len(p50s))
	for i, r := range p50s {
		each[i] = fmt.Sprintf("%.2f", r)
	}
	return fmt.Sprintf("%s (median %.2fx, mean %.2fx; p50 ratio of each round %s)", v, med, median(means), strings.Join(each, ", "))
}

func (b *bench) renderLookups(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	p("\n## Lookup latency: getaddrinfo-style ndots:5 lookups of external names through the eBPF datapath\n\n")
	if !b.cfg.datapath {
		p("Not run (-datapath=false).\n")
		return
	}
	if b.lookups.skipped != "" {
		p("**NOT MEASURED**: %s.\n", b.lookups.skipped)
		return
	}
	p("bench/lookup in the captured cgroup, to %s:53 (redirected to the agent, `--mode ebpf`): %d external names, each lookup tries the three search suffixes, then the name, with A and AAAA in parallel per try, "+
		"stopping at the first try with addresses. Cold = each name for the first time (upstream miss, fake upstream in the namespace); warm = the same names again (cached), "+
		"%[3]d rounds of %[4]d passes with the two clients taking turns; the warm columns are each client's round with the median p50, the ratio the median of the rounds' ratios. "+
		"CoreDNS (autopath needs its kubernetes plugin with `pods verified`, so a Kubernetes API server) is not run here.\n\n", dpNameserver, lookupNames, lookupRounds, lookupPasses)
	p("| client | cold mean µs | cold queries/lookup | warm mean / p50 / p99 µs | warm queries/lookup |\n|---|---:|---:|---|---:|\n")
	for _, r := range b.lookups.rows {
		if r.err != "" {
			p("| %s | ERROR: %s | | | |\n", r.label, r.err)
			continue
		}
		p("| %s | %.0f | %.1f | %.0f / %.0f / %.0f | %.1f |\n", r.label, r.cold.MeanUS, r.cold.QueriesPerLookup,
			r.warm.MeanUS, r.warm.P50US, r.warm.P99US, r.warm.QueriesPerLookup)
	}
	p("\nAutopath / no autopath, warm lookup time: %s; target <= 0.3x (median).\n", b.lookups.verdict())
}
