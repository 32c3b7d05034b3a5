//go:build linux

// Command benchrun is the benchmark harness behind `make bench` (see
// bench/run.sh): it generates one mesh table for every peer, starts each peer
// (our resolver, CoreDNS with a production-style chain and with hosts only, a
// bare miekg/dns floor, unbound, dnsmasq) pinned to one core with dnsperf on the
// other, runs the same warm-up and scenarios against each, and prints one table
// of ratios measured in this run, also written to bench/RESULTS.md. It also runs
// the table-size scale test and (when the agent is available) the datapath
// comparison.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/dnsperf"
	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
)

type config struct {
	repo, work, out      string
	meshBin, coreDNS     string
	meshSkip, meshArgs   string
	fakeBin, floorBin    string
	lookupBin, echoBin   string
	unboundBin, dnsmasq  string
	peers, scenarios     []string
	reps                 int
	duration             time.Duration
	warmPasses           int
	latQPS               int
	latDuration          time.Duration
	latReps              int
	clients, outstanding int
	serverCPU, genCPU    int
	basePort             int
	tableSize            int
	scaleSizes           []int
	scale, datapath      bool
	attrRounds           int
	attrPerf             bool
	verbose, quick       bool
	waitIdle             time.Duration
}

func parseConfig() (config, error) {
	var c config
	var peers, scen, sizes string
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		cache = filepath.Join(os.Getenv("HOME"), ".cache")
	}
	flag.StringVar(&c.repo, "repo", ".", "repository root")
	flag.StringVar(&c.work, "work", filepath.Join(os.TempDir(), "meshdns-bench"), "scratch directory (data, configs, logs)")
	flag.StringVar(&c.out, "out", "bench/RESULTS.md", "results file (relative to -repo)")
	flag.StringVar(&c.meshBin, "meshdns", "bin/meshdns-ebpf", "our binary (relative to -repo); missing = skipped")
	flag.StringVar(&c.meshArgs, "meshdns-args", "--authoritative=true", "extra flags for our resolver (space-separated); every peer is authoritative for the mesh zone")
	flag.StringVar(&c.meshSkip, "meshdns-skip", "", "skip meshdns with this reason (run.sh sets it when the build fails)")
	flag.StringVar(&c.coreDNS, "coredns", filepath.Join(cache, "meshdns-bench", "bin", "coredns"), "CoreDNS binary")
	flag.StringVar(&c.fakeBin, "fakeupstream", "", "fake upstream binary (built by run.sh)")
	flag.StringVar(&c.floorBin, "floor", "", "floor server binary (built by run.sh)")
	flag.StringVar(&c.lookupBin, "lookup", "", "getaddrinfo-style lookup timer (built by run.sh; empty skips the lookup-latency table)")
	flag.StringVar(&c.echoBin, "echo", "", "machine-floor echo server (bench/echo, built by run.sh; empty skips the machine floor)")
	flag.StringVar(&c.unboundBin, "unbound", "unbound", "unbound binary")
	flag.StringVar(&c.dnsmasq, "dnsmasq", "dnsmasq", "dnsmasq binary")
	flag.StringVar(&peers, "peers", strings.Join(allPeers, ","), "servers to run, in order")
	flag.StringVar(&scen, "scenarios", "table,fwd,ndots", "scenarios: table, fwd, ndots")
	flag.IntVar(&c.reps, "reps", 3, "saturation repetitions per scenario (median reported)")
	flag.DurationVar(&c.duration, "duration", 10*time.Second, "length of one saturation run")
	flag.IntVar(&c.warmPasses, "warm-passes", 2, "warm-up passes over each query file")
	flag.IntVar(&c.latQPS, "lat-qps", 20000, "offered rate of the fixed-rate run (scenario d)")
	flag.DurationVar(&c.latDuration, "lat-duration", 5*time.Second, "length of one fixed-rate run")
	flag.IntVar(&c.latReps, "lat-reps", 3, "fixed-rate repetitions (the run with the median p99 is reported; datapath: median p50)")
	flag.IntVar(&c.clients, "clients", 4, "dnsperf -c")
	flag.IntVar(&c.outstanding, "outstanding", 200, "dnsperf -q")
	flag.IntVar(&c.serverCPU, "server-cpu", 1, "core the server is pinned to")
	flag.IntVar(&c.genCPU, "gen-cpu", 0, "core dnsperf and the fake upstream are pinned to")
	flag.IntVar(&c.basePort, "base-port", 25300, "first loopback port used")
	flag.IntVar(&c.tableSize, "table-size", 1000, "services in the mesh table")
	flag.StringVar(&sizes, "scale-sizes", "1000,10000,100000", "table sizes of the scale test")
	flag.BoolVar(&c.scale, "scale", true, "run the scale test (needs our binary)")
	flag.BoolVar(&c.datapath, "datapath", true, "run the datapath comparison (needs the agent)")
	flag.BoolVar(&c.attrPerf, "attribution-perf", false, "record a perf profile (perf record -g) of the agent during each attribution run, into -work (for finding where the CPU goes)")
	flag.IntVar(&c.attrRounds, "attribution-rounds", 5, "rounds of the attribution cost runs (attribution off and on take turns; 0 skips them; needs the agent)")
	flag.DurationVar(&c.waitIdle, "wait-idle", 0, "before starting, wait up to this long for both cores to be idle (other work running)")
	flag.BoolVar(&c.quick, "quick", false, "smoke mode: 1 x 3 s, 2 s fixed-rate, 1k/10k scale")
	flag.BoolVar(&c.verbose, "v", false, "print every dnsperf run")
	flag.Parse()
	c.peers = splitList(peers)
	c.scenarios = splitList(scen)
	for _, s := range splitList(sizes) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			return c, fmt.Errorf("bad -scale-sizes entry %q", s)
		}
		c.scaleSizes = append(c.scaleSizes, n)
	}
	if c.quick {
		c.quickDefaults()
	}
	if err := c.check(); err != nil {
		return c, err
	}
	var err error
	if c.repo, err = filepath.Abs(c.repo); err != nil {
		return c, err
	}
	for _, p := range []*string{&c.out, &c.meshBin} {
		if !filepath.IsAbs(*p) {
			*p = filepath.Join(c.repo, *p)
		}
	}
	return c, nil
}

// quickDefaults are the smoke mode's (-quick) settings; flags given
// explicitly win.
func (c *config) quickDefaults() {
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if !set["reps"] {
		c.reps = 1
	}
	if !set["duration"] {
		c.duration = 3 * time.Second
	}
	if !set["lat-duration"] {
		c.latDuration = 2 * time.Second
	}
	if !set["lat-reps"] {
		c.latReps = 1
	}
	if !set["attribution-rounds"] {
		c.attrRounds = 2
	}
	if !set["scale-sizes"] {
		c.scaleSizes = slices.DeleteFunc(c.scaleSizes, func(n int) bool { return n > 10000 })
	}
}

// check refuses settings that cannot run.
func (c *config) check() error {
	if c.latReps < 1 {
		return fmt.Errorf("-lat-reps %d: want at least 1", c.latReps)
	}
	for _, p := range c.peers {
		if !slices.Contains(allPeers, p) {
			return fmt.Errorf("unknown peer %q (have %v)", p, allPeers)
		}
	}
	for _, s := range c.scenarios {
		if !slices.Contains([]string{"table", "fwd", "ndots"}, s) {
			return fmt.Errorf("unknown scenario %q", s)
		}
	}
	if c.fakeBin == "" || c.floorBin == "" {
		return fmt.Errorf("-fakeupstream and -floor are required (bench/run.sh builds them)")
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// Port plan: every server on its own loopback port.
const (
	offUpstream      = 0
	offUpstreamStats = 99
	offMeshAdmin     = 91
	offProdHealth    = 81
	offProdReady     = 82
	offProdProm      = 83
	offEcho          = 40
)

var allPeers = []string{"meshdns", "coredns-prod", "coredns-hosts", "floor", "unbound", "dnsmasq"}

// bench holds the state of one harness run.
type bench struct {
	cfg         config
	dataDir     string
	logDir      string
	tab         meshdata.Table
	files       map[string]string // scenario -> query file
	upstream    *proc
	echo        *proc // the machine floor (nil without -echo)
	results     []peerResult
	scale       []scaleResult
	scaleErr    string
	datapath    datapathReport
	attribution attrReport
	lookups     lookupReport
	started     time.Time
	notes       []string
}

func (b *bench) echoPort() int { return b.cfg.basePort + offEcho }

// startEcho starts the machine-floor echo server on the server's core and
// waits until it answers.
func (b *bench) startEcho(ctx context.Context) (*proc, error) {
	p, err := start("echo", b.cfg.serverCPU, []string{b.cfg.echoBin, "127.0.0.1", strconv.Itoa(b.echoPort())}, nil, b.logDir)
	if err != nil {
		return nil, err
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := waitReply(wctx, p, fmt.Sprintf("127.0.0.1:%d", b.echoPort())); err != nil {
		p.stop()
		return nil, fmt.Errorf("echo server: %w", err)
	}
	b.echo = p
	return p, nil
}

// upstreamIP is where the fake upstream listens: a loopback address other than
// the servers' 127.0.0.1, because the agent drops an upstream whose IP equals
// its listen IP (whatever the port).
const upstreamIP = "127.0.0.2"

func (b *bench) upstreamAddr() string {
	return fmt.Sprintf("%s:%d", upstreamIP, b.cfg.basePort+offUpstream)
}

// upstreamQueries asks the fake upstream how many queries it has seen (-1 on error).
func (b *bench) upstreamQueries() int64 {
	c := http.Client{Timeout: time.Second}
	resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/queries", b.cfg.basePort+offUpstreamStats))
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	n, err := strconv.ParseInt(strings.TrimSpace(string(body)), 10, 64)
	if err != nil {
		return -1
	}
	return n
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "helper" {
		os.Exit(runHelper(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "budgets" {
		os.Exit(runBudgets(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "egress" {
		os.Exit(runEgress(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "kube-section" {
		os.Exit(runKubeSection(os.Args[2:]))
	}
	cfg, err := parseConfig()
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchrun:", err)
		os.Exit(2)
	}
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := runBench(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "benchrun:", err)
		os.Exit(1)
	}
}

func runBench(ctx context.Context, cfg config) error {
	b := &bench{cfg: cfg, started: time.Now()}
	b.dataDir = filepath.Join(cfg.work, "data")
	b.logDir = filepath.Join(cfg.work, "logs")
	for _, d := range []string{b.dataDir, b.logDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("create %s: %w", d, err)
		}
	}
	if err := b.generate(); err != nil {
		return err
	}
	if cfg.waitIdle > 0 {
		b.waitIdle(ctx, cfg.waitIdle)
	}
	up, err := start("fakeupstream", cfg.genCPU, []string{cfg.fakeBin,
		"-listen", b.upstreamAddr(), "-ttl", "300", "-nx", meshdata.NXSuffix + "," + meshdata.Zone,
		"-stats", fmt.Sprintf("127.0.0.1:%d", cfg.basePort+offUpstreamStats)}, nil, b.logDir)
	if err != nil {
		return err
	}
	b.upstream = up
	defer up.stop()
	if cfg.echoBin != "" {
		// The machine floor is a reference, not a peer: without it the run
		// goes on and the report says it was not measured.
		if echo, err := b.startEcho(ctx); err != nil {
			n := fmt.Sprintf("machine floor not measured: %v", err)
			b.notes = append(b.notes, n)
			fmt.Fprintln(os.Stderr, "benchrun:", n)
		} else {
			defer echo.stop()
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err = waitAnswer(wctx, up, b.upstreamAddr(), meshdata.ExternalName(0), meshdata.ExternalIP(meshdata.ExternalName(0)))
	cancel()
	if err != nil {
		return fmt.Errorf("fake upstream: %w", err)
	}

	for _, name := range cfg.peers {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		pr := b.runPeer(ctx, b.peer(name))
		b.results = append(b.results, pr)
	}
	if cfg.scale && ctx.Err() == nil {
		b.runScale(ctx)
	}
	if cfg.datapath && ctx.Err() == nil {
		b.datapath = b.runDatapath(ctx)
	}
	if cfg.attrRounds > 0 && ctx.Err() == nil {
		b.attribution = b.runAttribution(ctx)
	}
	report := b.render()
	fmt.Println(report)
	old, _ := os.ReadFile(cfg.out) // missing on the first run
	report = keepManual(report, string(old))
	if err := os.WriteFile(cfg.out, []byte(report), 0o644); err != nil {
		return fmt.Errorf("write %s: %w", cfg.out, err)
	}
	fmt.Fprintf(os.Stderr, "benchrun: wrote %s (logs and configs in %s)\n", cfg.out, cfg.work)
	return nil
}

// generate writes the data set, every peer's configuration and the query files.
func (b *bench) generate() error {
	b.tab = meshdata.NewTable(b.cfg.tableSize, 0)
	nt, err := b.tab.NameTableJSON()
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"table.hosts":    []byte(b.tab.Hosts()),
		"cluster.zone":   []byte(meshdata.ZoneFile()),
		"nametable.json": nt,
		"q-table.txt":    []byte(meshdata.QueryFile(b.tab.InTableQueries(1))),
		"q-fwd.txt":      []byte(meshdata.QueryFile(meshdata.ForwardQueries(1000, 2))),
		"q-ndots.txt":    []byte(meshdata.QueryFile(b.tab.NdotsQueries(1000, 3))),
		"unbound.conf":   []byte(b.tab.UnboundConf(b.cfg.basePort+portOf["unbound"], b.dataDir, upstreamIP, b.cfg.basePort+offUpstream)),
		"Corefile.hosts": []byte(meshdata.CorefileHosts(b.cfg.basePort+portOf["coredns-hosts"], b.path("table.hosts"), b.path("cluster.zone"), b.upstreamAddr())),
		"Corefile.prod":  []byte(meshdata.CorefileProd(b.cfg.basePort+portOf["coredns-prod"], b.prodPorts(), b.path("table.hosts"), b.path("cluster.zone"), b.upstreamAddr())),
	}
	for name, data := range files {
		if err := os.WriteFile(b.path(name), data, 0o644); err != nil {
			return fmt.Errorf("write %s: %w", name, err)
		}
	}
	b.files = map[string]string{"table": b.path("q-table.txt"), "fwd": b.path("q-fwd.txt"), "ndots": b.path("q-ndots.txt")}
	return nil
}

func (b *bench) path(name string) string { return filepath.Join(b.dataDir, name) }

func (b *bench) prodPorts() meshdata.ProdPorts {
	return meshdata.ProdPorts{Health: b.cfg.basePort + offProdHealth, Ready: b.cfg.basePort + offProdReady, Prometheus: b.cfg.basePort + offProdProm}
}

var portOf = map[string]int{"meshdns": 1, "coredns-prod": 2, "coredns-hosts": 3, "floor": 4, "unbound": 5, "dnsmasq": 6}

// peer describes how to start each server.
func (b *bench) peer(name string) peer {
	port := b.cfg.basePort + portOf[name]
	listen := fmt.Sprintf("127.0.0.1:%d", port)
	exists := func(path string) error {
		if _, err := os.Stat(path); err != nil {
			return fmt.Errorf("%s not found", path)
		}
		return nil
	}
	p := peer{name: name, port: port}
	switch name {
	case "meshdns":
		p.desc = "meshdns-ebpf run --mode off " + b.cfg.meshArgs + " (resolver only, all features and metrics on)"
		p.argv = func() ([]string, error) {
			if b.cfg.meshSkip != "" {
				return nil, errors.New(b.cfg.meshSkip)
			}
			if err := exists(b.cfg.meshBin); err != nil {
				return nil, fmt.Errorf("%w (build it: go build -o bin/meshdns-ebpf ./cmd/meshdns-ebpf)", err)
			}
			return b.meshArgv(listen, b.path("nametable.json"), b.cfg.basePort+offMeshAdmin), nil
		}
	case "coredns-prod", "coredns-hosts":
		file := map[string]string{"coredns-prod": "Corefile.prod", "coredns-hosts": "Corefile.hosts"}[name]
		p.desc = map[string]string{
			"coredns-prod":  "CoreDNS 1.14.7: errors, health, ready, hosts+file, prometheus, forward, cache 30, loop, reload, loadbalance",
			"coredns-hosts": "CoreDNS 1.14.7: hosts+file for the table, cache + forward for the rest",
		}[name]
		p.argv = func() ([]string, error) {
			if err := exists(b.cfg.coreDNS); err != nil {
				return nil, fmt.Errorf("%w (run scripts/install-bench-deps.sh)", err)
			}
			return []string{b.cfg.coreDNS, "-conf", b.path(file)}, nil
		}
	case "floor":
		p.desc = "bare miekg/dns server, map table + map cache (bench/floor)"
		p.argv = func() ([]string, error) {
			return []string{b.cfg.floorBin, "-listen", listen, "-hosts", b.path("table.hosts"),
				"-upstream", b.upstreamAddr(), "-ttl", strconv.Itoa(meshdata.MeshTTL)}, nil
		}
	case "unbound":
		p.desc = "unbound, 1 thread, local-zone static + local-data, forward-zone"
		p.argv = func() ([]string, error) {
			return []string{b.cfg.unboundBin, "-d", "-c", b.path("unbound.conf")}, nil
		}
	case "dnsmasq":
		p.desc = "dnsmasq, addn-hosts, --local=/cluster.local/, cache 10000"
		p.argv = func() ([]string, error) {
			return append([]string{b.cfg.dnsmasq}, meshdata.DnsmasqArgs(port, b.path("table.hosts"), fmt.Sprintf("%s#%d", upstreamIP, b.cfg.basePort+offUpstream))...), nil
		}
	}
	return p
}

// meshArgv is our resolver's command line in resolver-only mode.
func (b *bench) meshArgv(listen, names string, adminPort int) []string {
	argv := []string{b.cfg.meshBin, "run", "--mode", "off", "--listen", listen, "--names", names,
		"--upstream", b.upstreamAddr(), "--admin", fmt.Sprintf("127.0.0.1:%d", adminPort)}
	return append(argv, strings.Fields(b.cfg.meshArgs)...)
}

// scenarioResult is one scenario against one peer.
type scenarioResult struct {
	name      string
	sat       []run // saturation repetitions
	fixedRuns []run // fixed-rate repetitions
	fixed     *run  // the fixed-rate run with the median p99
	// echoRuns: the machine-floor echo server's fixed-rate run right after
	// each of fixedRuns (meshdns only, when -echo is given).
	echoRuns []run
	errText  string
}

type peerResult struct {
	peer    peer
	skipped string // reason, if not run
	failed  []string
	scen    map[string]*scenarioResult
}

func (b *bench) runPeer(ctx context.Context, p peer) peerResult {
	pr := peerResult{peer: p, scen: map[string]*scenarioResult{}}
	argv, err := p.argv()
	if err != nil {
		pr.skipped = err.Error()
		fmt.Fprintf(os.Stderr, "benchrun: SKIP %s: %s\n", p.name, pr.skipped)
		return pr
	}
	b.checkIdle("before " + p.name)
	fmt.Fprintf(os.Stderr, "benchrun: %s on 127.0.0.1:%d (cpu %d)\n", p.name, p.port, b.cfg.serverCPU)
	srv, err := start(p.name, b.cfg.serverCPU, argv, p.env, b.logDir)
	if err != nil {
		pr.skipped = err.Error()
		return pr
	}
	defer srv.stop()
	addr := fmt.Sprintf("127.0.0.1:%d", p.port)
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	svc := b.tab.Services[len(b.tab.Services)-1]
	err = waitAnswer(wctx, srv, addr, svc.FQDN(), svc.IP)
	cancel()
	if err != nil {
		pr.skipped = fmt.Sprintf("did not become ready: %v (log %s)", err, filepath.Join(b.logDir, p.name+".log"))
		fmt.Fprintf(os.Stderr, "benchrun: SKIP %s: %s\n", p.name, pr.skipped)
		return pr
	}
	pr.failed = runChecks(addr, checks(b.tab))
	for _, f := range pr.failed {
		fmt.Fprintf(os.Stderr, "benchrun: %s: CHECK FAILED: %s\n", p.name, f)
	}
	for _, s := range b.cfg.scenarios {
		if ctx.Err() != nil {
			break
		}
		sr := &scenarioResult{name: s}
		pr.scen[s] = sr
		if err := b.runScenario(ctx, srv, p, sr); err != nil {
			sr.errText = err.Error()
			fmt.Fprintf(os.Stderr, "benchrun: %s/%s: %v\n", p.name, s, err)
		}
	}
	return pr
}

func (b *bench) runScenario(ctx context.Context, srv *proc, p peer, sr *scenarioResult) error {
	base := dnsperf.Options{Server: "127.0.0.1", Port: p.port, DataFile: b.files[sr.name], Clients: b.cfg.clients, Threads: 1, Outstand: b.cfg.outstanding}
	warm := base
	warm.Passes = b.cfg.warmPasses
	if _, err := b.dnsperfRun(ctx, warm, 0); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	for i := range b.cfg.reps {
		o := base
		o.Duration = b.cfg.duration.Seconds()
		r, err := b.dnsperfRun(ctx, o, srv.pid())
		if err != nil {
			return fmt.Errorf("saturation run %d: %w", i+1, err)
		}
		sr.sat = append(sr.sat, r)
		fmt.Fprintf(os.Stderr, "  %-13s %-5s run %d: %9.0f qps  server %.2f core  gen %.2f core  other %.2f  %5.1f µs/q  lost %d  upstream %d\n",
			p.name, sr.name, i+1, r.res.QPS, r.serverBusy(), r.genBusy, r.otherWork(), r.usPerQuery(), r.res.Lost, r.upstreamQ)
	}
	for i := 0; b.cfg.latQPS > 0 && i < b.cfg.latReps; i++ {
		o := base
		o.Duration, o.MaxQPS, o.Verbose = b.cfg.latDuration.Seconds(), b.cfg.latQPS, true
		r, err := b.dnsperfRun(ctx, o, srv.pid())
		if err != nil {
			return fmt.Errorf("fixed-rate run %d: %w", i+1, err)
		}
		sr.fixedRuns = append(sr.fixedRuns, r)
		b.logFixed(p.name, sr.name, i, r)
		if b.echo != nil && p.name == "meshdns" {
			// The machine floor, right after: the same load on the same
			// core a moment later, answered by a server that does nothing.
			eo := o
			eo.Port = b.echoPort()
			er, err := b.dnsperfRun(ctx, eo, b.echo.pid())
			if err != nil {
				return fmt.Errorf("echo fixed-rate run %d: %w", i+1, err)
			}
			sr.echoRuns = append(sr.echoRuns, er)
			b.logFixed("echo", sr.name, i, er)
		}
	}
	sr.fixed = medianRun(sr.fixedRuns, p99)
	return nil
}

// logFixed prints one fixed-rate run (the i-th, from 0) of server on scenario.
func (b *bench) logFixed(server, scenario string, i int, r run) {
	fmt.Fprintf(os.Stderr, "  %-13s %-5s @%d run %d: p50 %.0f µs  p99 %.0f µs  %5.1f µs/q  lost %d\n",
		server, scenario, b.cfg.latQPS, i+1, p50(&r)*1e6, p99(&r)*1e6, r.usPerQuery(), r.res.Lost)
}

// checkIdle samples both cores for a second while nothing of ours runs and
// records a note when other work is using them: the numbers of this run are
// then not trustworthy.
func (b *bench) checkIdle(when string) {
	busy, err := procstat.CoreBusy([]int{b.cfg.genCPU, b.cfg.serverCPU}, time.Second)
	if err != nil {
		b.notes = append(b.notes, fmt.Sprintf("idle check %s: %v", when, err))
		return
	}
	for _, c := range []int{b.cfg.genCPU, b.cfg.serverCPU} {
		if busy[c] > 0.10 {
			n := fmt.Sprintf("NOISY: CPU %d was %.0f%% busy with other work %s (idle check); numbers involving it are unreliable", c, busy[c]*100, when)
			b.notes = append(b.notes, n)
			fmt.Fprintln(os.Stderr, "benchrun:", n)
		}
	}
}

// waitIdle waits until both cores are below 10% busy for 3 s in a row, or max.
func (b *bench) waitIdle(ctx context.Context, max time.Duration) {
	deadline := time.Now().Add(max)
	quiet := 0
	for quiet < 3 && time.Now().Before(deadline) && ctx.Err() == nil {
		busy, err := procstat.CoreBusy([]int{b.cfg.genCPU, b.cfg.serverCPU}, time.Second)
		if err != nil {
			return
		}
		if busy[b.cfg.genCPU] < 0.10 && busy[b.cfg.serverCPU] < 0.10 {
			quiet++
			continue
		}
		if quiet == 0 {
			fmt.Fprintf(os.Stderr, "benchrun: waiting for idle cores (cpu%d %.0f%%, cpu%d %.0f%%)\n",
				b.cfg.genCPU, busy[b.cfg.genCPU]*100, b.cfg.serverCPU, busy[b.cfg.serverCPU]*100)
		}
		quiet = 0
	}
	if quiet < 3 {
		b.notes = append(b.notes, fmt.Sprintf("cores were still busy with other work after waiting %s; started anyway", max))
	}
}

// manualMarker starts the hand-written part of RESULTS.md (what was tried and
// what each change gained); benchrun keeps it across runs.
const manualMarker = "<!-- hand-written below: kept by benchrun across runs -->"

// keepManual appends the hand-written tail of old (from manualMarker on) to
// report, or an empty one with the marker.
func keepManual(report, old string) string {
	tail := manualMarker + "\n\n## What was tried (optimisation log)\n\n_Nothing yet._\n"
	if i := strings.Index(old, manualMarker); i >= 0 {
		tail = old[i:]
	}
	return strings.TrimRight(report, "\n") + "\n\n" + tail
}

// kubeHeading starts bench/kube's section of RESULTS.md (its tables of the
// node mode against CoreDNS's kubernetes plugin and of the mesh sources),
// which run.sh puts right above the hand-written part.
const kubeHeading = "## Kubernetes node mode vs CoreDNS's kubernetes plugin"

// withKubeSection puts kube, bench/kube's section, into results right above
// the hand-written part, in place of every Kubernetes section an earlier run
// left there (from kubeHeading to the marker).
func withKubeSection(results, kube string) string {
	head, manual := results, ""
	if i := strings.Index(results, manualMarker); i >= 0 {
		head, manual = results[:i], results[i:]
	}
	if i := strings.Index(head, kubeHeading+"\n"); i >= 0 && (i == 0 || head[i-1] == '\n') {
		head = head[:i]
	}
	return keepManual(strings.TrimRight(head, "\n")+"\n\n"+strings.TrimRight(kube, "\n")+"\n", manual)
}

// runKubeSection is `benchrun kube-section KUBE.md RESULTS.md`: run.sh's
// step that puts bench/kube's output into RESULTS.md.
func runKubeSection(args []string) int {
	if len(args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: benchrun kube-section KUBE.md RESULTS.md")
		return 2
	}
	kube, err := os.ReadFile(args[0])
	if err == nil && !strings.HasPrefix(string(kube), kubeHeading) {
		err = fmt.Errorf("%s does not start with %q", args[0], kubeHeading)
	}
	var results []byte
	if err == nil {
		results, err = os.ReadFile(args[1])
	}
	if err == nil {
		err = os.WriteFile(args[1], []byte(withKubeSection(string(results), string(kube))), 0o644)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchrun kube-section:", err)
		return 1
	}
	return 0
}
