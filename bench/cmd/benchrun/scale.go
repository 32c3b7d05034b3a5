//go:build linux

package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/dnsperf"
	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
)

// scaleResult is one table size against one server.
type scaleResult struct {
	server string
	size   int
	// ready is exec -> first correct answer for the table's last name: an upper
	// bound of the build time that includes process start.
	ready time.Duration
	// build is the server's own table build/load time when it exports one as a
	// meshdns_*_seconds metric (0: not exported).
	build     time.Duration
	buildFrom string
	mem       procstat.Mem // after load
	steady    *run         // fixed rate, no reload
	// partial rewrites 1% of the names (and the probed one) at each
	// reload, full every address; partial runs first, so its VmHWM is
	// that of the load and the partial reloads.
	partial, full reloadRun
	err           string
}

// reloadRun is a fixed-rate run while the table file is rewritten
// scaleReloads times.
type reloadRun struct {
	run *run
	lat []time.Duration // rewrite -> the new address answered, per reload
	err string          // a reload not served
	mem procstat.Mem    // after the run
}

func (s scaleResult) buildText() string {
	if s.build > 0 {
		return fmt.Sprintf("build %s (%s), ready %s", s.build.Round(time.Millisecond), s.buildFrom, s.ready.Round(time.Millisecond))
	}
	return fmt.Sprintf("ready %s after exec (no build-time metric)", s.ready.Round(time.Millisecond))
}

// scaleReloads is how many times the table is rewritten during a reload run.
const scaleReloads = 3

// partialEvery: a partial rewrite changes one name in partialEvery.
const partialEvery = 100

// runScale measures table sizes on meshdns and, as a reference, on the floor
// (which reloads by polling its hosts file every 250 ms).
func (b *bench) runScale(ctx context.Context) {
	servers := []string{"floor"}
	if _, err := os.Stat(b.cfg.meshBin); err == nil {
		servers = append([]string{"meshdns"}, servers...)
	} else {
		b.scaleErr = fmt.Sprintf("meshdns not measured: %s not found", b.cfg.meshBin)
		fmt.Fprintf(os.Stderr, "benchrun: scale: SKIP meshdns: %s not found; running the floor only\n", b.cfg.meshBin)
	}
	for _, srv := range servers {
		for _, n := range b.cfg.scaleSizes {
			if ctx.Err() != nil {
				return
			}
			sc := b.scaleOne(ctx, srv, n)
			if sc.err != "" {
				fmt.Fprintf(os.Stderr, "benchrun: scale %s %d: %s\n", srv, n, sc.err)
			}
			b.scale = append(b.scale, sc)
		}
	}
}

func (b *bench) scaleOne(ctx context.Context, server string, n int) scaleResult {
	sc := scaleResult{server: server, size: n}
	dir := filepath.Join(b.cfg.work, "scale", fmt.Sprintf("%s-%d", server, n))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		sc.err = err.Error()
		return sc
	}
	port := b.cfg.basePort + 10 + portOf[server]
	listen := fmt.Sprintf("127.0.0.1:%d", port)
	file := tableFile{meshdns: server == "meshdns"}
	var argv []string
	if file.meshdns {
		file.path = filepath.Join(dir, "nametable.json")
		argv = b.meshArgv(listen, file.path, b.cfg.basePort+10+offMeshAdmin)
	} else {
		file.path = filepath.Join(dir, "table.hosts")
		argv = []string{b.cfg.floorBin, "-listen", listen, "-hosts", file.path, "-upstream", b.upstreamAddr(), "-reload", "250ms"}
	}
	data, err := file.render(meshdata.NewTable(n, 0))
	if err == nil {
		err = file.put(data)
	}
	if err != nil {
		sc.err = err.Error()
		return sc
	}
	tab := meshdata.NewTable(n, 0)
	qfile := filepath.Join(dir, "q-table.txt")
	if err := os.WriteFile(qfile, []byte(meshdata.QueryFile(tab.InTableQueries(uint64(n)))), 0o644); err != nil {
		sc.err = err.Error()
		return sc
	}
	fmt.Fprintf(os.Stderr, "benchrun: scale %s %d services\n", server, n)
	t0 := time.Now()
	srv, err := start(fmt.Sprintf("scale-%s-%d", server, n), b.cfg.serverCPU, argv, nil, b.logDir)
	if err != nil {
		sc.err = err.Error()
		return sc
	}
	defer srv.stop()
	last := len(tab.Services) - 1
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	err = waitAnswer(wctx, srv, listen, tab.Services[last].FQDN(), tab.Services[last].IP)
	cancel()
	if err != nil {
		sc.err = err.Error()
		return sc
	}
	sc.ready = time.Since(t0)
	if server == "meshdns" {
		sc.build, sc.buildFrom = scrapeBuildTime(fmt.Sprintf("127.0.0.1:%d", b.cfg.basePort+10+offMeshAdmin))
	}
	if sc.build == 0 {
		if d, ok := logBuildTime(srv.log.Name()); ok {
			sc.build, sc.buildFrom = d, "its log"
		}
	}
	time.Sleep(time.Second) // let the runtime settle (GC after load)
	if sc.mem, err = procstat.Memory(srv.pid()); err != nil {
		sc.err = err.Error()
		return sc
	}
	o := dnsperf.Options{Server: "127.0.0.1", Port: port, DataFile: qfile, Clients: b.cfg.clients, Threads: 1,
		Outstand: b.cfg.outstanding, MaxQPS: b.cfg.latQPS, Verbose: true, Duration: b.cfg.latDuration.Seconds()}
	warm := o
	warm.MaxQPS, warm.Verbose, warm.Duration, warm.Passes = 0, false, 0, 1
	if _, err := b.dnsperfRun(ctx, warm, 0); err != nil {
		sc.err = fmt.Sprintf("warm-up: %v", err)
		return sc
	}
	steady, err := b.dnsperfRun(ctx, o, srv.pid())
	if err != nil {
		sc.err = err.Error()
		return sc
	}
	sc.steady = &steady

	// Reload runs: rewrite the table while dnsperf runs at the fixed rate and
	// time how long each new generation takes to show in answers. First 1% of
	// the names per rewrite (generations 1-3 of those), then every address
	// (generations 4-6).
	probe := reloadProbe{listen: listen, name: tab.Services[last].FQDN(), last: last}
	sc.partial = b.reloadRun(ctx, o, srv, file, probe, 1, func(gen int) meshdata.Table {
		return meshdata.PartialTable(n, 0, gen, partialEvery)
	})
	sc.full = b.reloadRun(ctx, o, srv, file, probe, 1+scaleReloads, func(gen int) meshdata.Table {
		return meshdata.NewTable(n, gen)
	})
	for _, r := range []reloadRun{sc.partial, sc.full} {
		if r.run == nil && sc.err == "" {
			sc.err = r.err
		}
	}
	return sc
}

// tableFile is a server's table file.
type tableFile struct {
	path    string
	meshdns bool // our JSON name table; else a hosts file
}

// render is the file's content for tab.
func (f tableFile) render(tab meshdata.Table) ([]byte, error) {
	if f.meshdns {
		return tab.NameTableJSON()
	}
	return []byte(tab.Hosts()), nil
}

// put replaces the file with data atomically (write + rename), as a
// config-map update or a careful writer does.
func (f tableFile) put(data []byte) error {
	tmp := f.path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	return os.Rename(tmp, f.path)
}

// reloadProbe is the name whose answer shows that a rewrite was loaded.
type reloadProbe struct {
	listen, name string
	last         int // its index in the table
}

// reloadRun runs dnsperf at the fixed rate while the table is rewritten
// scaleReloads times (generations gen0 on, each table made by table), 2 s
// apart, and times each rewrite (from the write of the file, rendered
// before the run) until the probe answers its new address.
func (b *bench) reloadRun(ctx context.Context, o dnsperf.Options, srv *proc, file tableFile,
	probe reloadProbe, gen0 int, table func(gen int) meshdata.Table) reloadRun {
	var rr reloadRun
	var files [][]byte
	for gen := gen0; gen < gen0+scaleReloads; gen++ {
		data, err := file.render(table(gen))
		if err != nil {
			rr.err = err.Error()
			return rr
		}
		files = append(files, data)
	}
	o.Duration = float64(scaleReloads*3 + 1)
	type out struct {
		r   run
		err error
	}
	done := make(chan out, 1)
	go func() {
		r, err := b.dnsperfRun(ctx, o, srv.pid())
		done <- out{r, err}
	}()
	for gen := gen0; gen < gen0+scaleReloads; gen++ {
		select {
		case <-time.After(2 * time.Second):
		case <-ctx.Done():
		}
		t := time.Now()
		if err := file.put(files[gen-gen0]); err != nil {
			rr.err = err.Error()
			break
		}
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := waitAnswer(wctx, nil, probe.listen, probe.name, meshdata.ServiceIP(probe.last, gen))
		cancel()
		if err != nil {
			rr.err = fmt.Sprintf("generation %d not served within 5 s: %v", gen, err)
			break
		}
		rr.lat = append(rr.lat, time.Since(t))
	}
	res := <-done
	if res.err != nil {
		rr.err = res.err.Error()
		return rr
	}
	rr.run = &res.r
	var err error
	if rr.mem, err = procstat.Memory(srv.pid()); err != nil {
		rr.err = err.Error()
	}
	return rr
}

var (
	logText = regexp.MustCompile(`table (?:re)?loaded.*?\b(?:duration|took)=([0-9.]+[a-zµ]+)`)
	logJSON = regexp.MustCompile(`table (?:re)?loaded.*?"(?:duration|took)":\s*([0-9]+)`)
)

// logBuildTime finds the first "... table loaded ... duration=X" line a server
// logged (slog text: a Go duration; slog JSON: nanoseconds).
func logBuildTime(path string) (time.Duration, bool) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if m := logText.FindStringSubmatch(line); m != nil {
			if d, err := time.ParseDuration(m[1]); err == nil {
				return d, true
			}
		}
		if m := logJSON.FindStringSubmatch(line); m != nil {
			if ns, err := strconv.ParseInt(m[1], 10, 64); err == nil {
				return time.Duration(ns), true
			}
		}
	}
	return 0, false
}

var buildMetric = regexp.MustCompile(`^(meshdns_[a-z_]*_(?:build|load)_(?:duration_)?seconds(?:_sum|_count)?)(\{[^}]*\})?\s+([0-9.eE+-]+)$`)

// scrapeBuildTime looks for a table build/load duration in our admin metrics: a
// gauge, or a histogram/summary's _sum divided by _count.
func scrapeBuildTime(admin string) (time.Duration, string) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + admin + "/metrics")
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	vals := map[string]float64{}
	for line := range strings.SplitSeq(string(body), "\n") {
		m := buildMetric.FindStringSubmatch(strings.TrimSpace(line))
		if m == nil || strings.HasSuffix(m[1], "_bucket") {
			continue
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err == nil {
			vals[m[1]] += v
		}
	}
	for name, v := range vals {
		if base, ok := strings.CutSuffix(name, "_sum"); ok {
			if cnt := vals[base+"_count"]; cnt > 0 {
				// First load is the only observation right after start.
				return time.Duration(v / cnt * float64(time.Second)), base + " (mean)"
			}
			continue
		}
		if strings.HasSuffix(name, "_count") || strings.HasSuffix(name, "_total") {
			continue
		}
		return time.Duration(v * float64(time.Second)), name
	}
	return 0, ""
}

func (b *bench) renderScale(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	p("\n## Scale: name table size\n\n")
	if !b.cfg.scale {
		p("Not run (-scale=false).\n")
		return
	}
	if b.scaleErr != "" {
		p("> %s. The floor rows are a reference only (it reloads by polling every 250 ms).\n\n", b.scaleErr)
	}
	p("Fixed rate %d QPS of in-table queries over all names. Reload runs: while dnsperf runs, the table file is atomically "+
		"replaced (write + rename) %d times, first with 1 in %d names given a new address (\"1%%\"), then with every address new "+
		"(\"full\"); reload latency = rewrite -> the new address answered. VmHWM is the process's peak: after the 1%% "+
		"rewrites it covers the load and those reloads, after the full rewrites everything.\n\n", b.cfg.latQPS, scaleReloads, partialEvery)
	p("| server | services | build / ready | VmRSS after load | VmHWM after 1%% / full rewrites | p50 / p99 µs steady | " +
		"p50 / p99 / max µs during 1%% rewrites | during full rewrites | lost | reload latency 1%% | reload latency full |\n")
	p("|---|---:|---|---:|---|---|---|---|---:|---|---|\n")
	for _, s := range b.scale {
		if s.err != "" {
			p("| %s | %d | ERROR: %s | | | | | | | | |\n", s.server, s.size, s.err)
			continue
		}
		steady, lost := "-", uint64(0)
		if s.steady != nil {
			steady = fmt.Sprintf("%.0f / %.0f", s.steady.res.Percentile(0.5)*1e6, s.steady.res.Percentile(0.99)*1e6)
			lost += s.steady.res.Lost
		}
		for _, r := range []reloadRun{s.partial, s.full} {
			if r.run != nil {
				lost += r.run.res.Lost
			}
		}
		p("| %s | %d | %s | %.1f MB | %.1f / %.1f MB | %s | %s | %s | %d | %s | %s |\n", s.server, s.size, s.buildText(),
			mb(s.mem.RSS), mb(s.partial.mem.HWM), mb(s.full.mem.HWM), steady, s.partial.during(), s.full.during(), lost,
			s.partial.latText(), s.full.latText())
	}
	b.renderScaleTargets(w)
}

// during is the run's p50 / p99 / max in µs.
func (r reloadRun) during() string {
	if r.run == nil {
		return "-"
	}
	res := r.run.res
	return fmt.Sprintf("%.0f / %.0f / %.0f", res.Percentile(0.5)*1e6, res.Percentile(0.99)*1e6, res.Percentile(1)*1e6)
}

// latText lists the reload latencies, and the error that ended the run.
func (r reloadRun) latText() string {
	var lat []string
	for _, d := range r.lat {
		lat = append(lat, d.Round(time.Millisecond).String())
	}
	t := strings.Join(lat, ", ")
	if r.err != "" {
		t += " ERROR: " + r.err
	}
	return t
}

// renderScaleTargets judges the 100k-name file table: its build, and the
// peak memory and the query p99 through each kind of reload.
func (b *bench) renderScaleTargets(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	s := b.scaleOf("meshdns", 100000)
	if s.server == "" {
		return
	}
	p("\n### Targets (file table of 100k names)\n\n")
	build := s.ready
	if s.build > 0 {
		build = s.build
	}
	p("- built in < 1 s: %s (%s)\n", verdict(build < time.Second), s.buildText())
	floor := b.scaleOf("floor", s.size)
	for _, r := range []struct {
		name        string
		r, floorRun reloadRun
	}{{"1% rewrites", s.partial, floor.partial}, {"full rewrites", s.full, floor.full}} {
		if r.r.run == nil {
			p("- %s: NOT MEASURED (%s)\n", r.name, r.r.err)
			continue
		}
		p99 := r.r.run.res.Percentile(0.99) * 1e6
		p("- VmHWM through the load and the %s <= 150 MB: %s (%.1f MB)\n", r.name, verdict(mb(r.r.mem.HWM) <= 150), mb(r.r.mem.HWM))
		p("- query p99 @%d QPS during the %s <= 1 ms: %s (%.0f µs", b.cfg.latQPS, r.name, verdict(p99 <= 1000), p99)
		if r.floorRun.run != nil {
			p("; the floor's during its own reloads of the same table: %.0f µs", r.floorRun.run.res.Percentile(0.99)*1e6)
		}
		p(")\n")
	}
}

// scaleOf is the scale result of server at size (zero when not measured).
func (b *bench) scaleOf(server string, size int) scaleResult {
	for _, s := range b.scale {
		if s.server == server && s.size == size && s.err == "" {
			return s
		}
	}
	return scaleResult{}
}
