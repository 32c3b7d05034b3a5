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

const lookupNames = 300

type lookupResult struct {
	Lookups, Failed, Queries int
	MeanUS, P50US, P99US     float64
	QueriesPerLookup         float64
}

type lookupRow struct {
	label      string
	cold, warm lookupResult
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
	// The table plus the client map: the captured client reaches the agent from the
	// listen address's side of loopback.
	var tab map[string]any
	nt, err := b.tab.NameTableJSON()
	if err == nil {
		err = json.Unmarshal(nt, &tab)
	}
	if err != nil {
		return lookupReport{skipped: err.Error()}
	}
	tab["clients"] = map[string]string{dpListenIP: own}
	nt, _ = json.Marshal(tab)
	names := b.path("nametable-clients.json")
	if err := os.WriteFile(names, nt, 0o644); err != nil {
		return lookupReport{skipped: err.Error()}
	}
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
		return lookupReport{skipped: err.Error()}
	}
	defer srv.stop()
	svc := b.tab.Services[0]
	deadline := time.Now().Add(30 * time.Second)
	for env.digIn(dpListenIP, port, svc.FQDN()) != svc.IP.String() {
		if srv.exited() || time.Now().After(deadline) || ctx.Err() != nil {
			return lookupReport{skipped: "agent not answering; see " + srv.log.Name()}
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // first heartbeat/ready before capture is judged

	rep := lookupReport{rows: []lookupRow{
		{label: fmt.Sprintf("autopath (client known: search %s.svc...)", own)},
		{label: fmt.Sprintf("no autopath (search path unknown: %s.svc...)", other)},
	}}
	searches := []string{strings.Join(meshdata.SearchList(own), ","), strings.Join(meshdata.SearchList(other), ",")}
	for i := range rep.rows {
		// Disjoint names per variant, so each cold pass really misses.
		var list strings.Builder
		for j := range lookupNames {
			fmt.Fprintf(&list, "l%d-%s\n", j, strings.TrimSuffix(meshdata.ExternalName(j+i*lookupNames), "."))
		}
		file := b.path(fmt.Sprintf("lookup-names-%d.txt", i))
		if err := os.WriteFile(file, []byte(list.String()), 0o644); err != nil {
			rep.rows[i].err = err.Error()
			continue
		}
		run := func(passes int) (lookupResult, error) {
			argv := append(env.clientPrefix(), b.cfg.lookupBin, "-server", dpNameserver+":53", "-names", file,
				"-search", searches[i], "-ndots", "5", "-passes", fmt.Sprint(passes))
			cmd := exec.CommandContext(ctx, "taskset", append([]string{"-c", fmt.Sprint(b.cfg.genCPU)}, argv...)...)
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
		if rep.rows[i].cold, err = run(1); err != nil {
			rep.rows[i].err = "cold: " + err.Error()
			continue
		}
		if rep.rows[i].warm, err = run(3); err != nil {
			rep.rows[i].err = "warm: " + err.Error()
		}
		r := &rep.rows[i]
		fmt.Fprintf(os.Stderr, "  lookup %-50s cold mean %.0f µs (%.1f queries)  warm mean %.0f µs p99 %.0f µs (%.1f queries)\n",
			r.label, r.cold.MeanUS, r.cold.QueriesPerLookup, r.warm.MeanUS, r.warm.P99US, r.warm.QueriesPerLookup)
	}
	return rep
}

// ratio is the autopath lookup's median (and mean) time over the one without (warm),
// or 0. The median decides: a busy machine's stalls land in the mean of either side.
func (l lookupReport) ratio() (median, mean float64) {
	if l.skipped != "" || len(l.rows) != 2 || l.rows[0].err != "" || l.rows[1].err != "" || l.rows[1].warm.P50US == 0 {
		return 0, 0
	}
	a, b := l.rows[0].warm, l.rows[1].warm
	return a.P50US / b.P50US, a.MeanUS / b.MeanUS
}

func (l lookupReport) verdict() string {
	med, mean := l.ratio()
	if med == 0 {
		return "NOT MEASURED"
	}
	v := "FAIL"
	if med <= 0.3 {
		v = "PASS"
	}
	return fmt.Sprintf("%s (median %.2fx, mean %.2fx)", v, med, mean)
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
		"stopping at the first try with addresses. Cold = each name for the first time (upstream miss, fake upstream in the namespace); warm = the same names again (3 passes, cached). "+
		"CoreDNS (autopath needs its kubernetes plugin with `pods verified`, so a Kubernetes API server) is not run here.\n\n", dpNameserver, lookupNames)
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
