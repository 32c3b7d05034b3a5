//go:build linux

package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/dnsperf"
	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
)

// ---------------------------------------------------------------------------
// ATTRIBUTION COST: what naming every query's sender costs (docs/observability.md).
// The same eBPF datapath environment as the datapath comparison (a fresh
// network namespace, a private bpffs): an agent in --mode ebpf with
// --attribution=false and one with attribution on run side by side, each
// capturing a cgroup of its own (same nameserver, own listen port), and their
// clients (dnsperf, in those cgroups) take turns, one fixed-rate run at a
// time, in every scenario; so the flow record written by the attribute
// program, the resolver's lookup of it and the per-workload counting are all
// on the measured path, and the machine's drift falls on both alike. The
// attribution agent is measured three ways per scenario and round: no tap
// client; a stuck tap client (subscribed, never reading); a tap client that
// reads everything. The order within a round alternates (off, on, stuck, tap;
// then on, off, tap, stuck). Reported per variant and scenario: the agent's
// CPU µs per query (median over the rounds, every run listed), p50/p99, for
// the stuck client the agent's VmRSS and VmHWM, and with -attribution-perf the
// share of the agent's CPU in attribution's code.
//
// Then the cost of the attribute program (cgroup_skb/egress) for ordinary,
// non-DNS traffic of a captured cgroup: with the attribution agent running, a
// sender in the captured cgroup and one in the uncaptured sibling cgroup take
// turns sending connected UDP datagrams (64 bytes, to a veth whose peer is
// down, which drops them: every datagram passes the egress hook and nothing
// else of ours) and a TCP stream (to a sink in the namespace). Reported: packets (or MB) per second
// and the sender's CPU per packet (or per MB).
// ---------------------------------------------------------------------------

// attrVariants in the order the attribution-on agent runs them per scenario.
var attrVariants = []struct{ name, tap string }{
	{"off", ""},           // --attribution=false
	{"on", ""},            // attribution on, no tap client
	{"on+stuck", "stuck"}, // one tap client subscribed to everything that never reads
	{"on+tap", "read"},    // one tap client subscribed to everything, reading
}

// attrRun is one fixed-rate run of a variant.
type attrRun struct {
	run
	round int
	load1 float64 // the 1-minute load average when it started
	// tap client: records it got and lost notices (read), or the agent's
	// memory before the client subscribed and after the run (stuck).
	records, lost int64
	memBefore     procstat.Mem       // before the client subscribed
	memSubscribed procstat.Mem       // once it had
	memAfter      procstat.Mem       // after the run
	perf          map[string]float64 // with -attribution-perf: see attrPerf
}

type attrReport struct {
	skipped string
	runs    map[string]map[string][]attrRun // variant -> scenario -> runs
	egress  []egressRun
	loads   []string // load averages at the start of each round
	errs    []string
}

func (a *attrReport) add(variant, scenario string, r attrRun) {
	if a.runs[variant] == nil {
		a.runs[variant] = map[string][]attrRun{}
	}
	a.runs[variant][scenario] = append(a.runs[variant][scenario], r)
}

// loadAvg is /proc/loadavg's first three fields, and the first as a number.
func loadAvg() (string, float64) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?", math.NaN()
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?", math.NaN()
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return strings.Join(f[:3], " "), v
}

func (b *bench) runAttribution(ctx context.Context) attrReport {
	rep := attrReport{runs: map[string]map[string][]attrRun{}}
	if b.cfg.meshSkip != "" {
		rep.skipped = "needs the agent: " + b.cfg.meshSkip
		return rep
	}
	env, err := newDPEnv(b.cfg.work)
	if err != nil {
		rep.skipped = "setup: " + err.Error()
		return rep
	}
	defer func() {
		for _, e := range env.cleanup() {
			b.notes = append(b.notes, "attribution cleanup: "+e)
		}
	}()
	up, fakePort, resolv, err := b.startDPUpstream(env)
	if err != nil {
		rep.skipped = err.Error()
		return rep
	}
	defer up.stop()
	off, on, err := b.startAttrAgents(ctx, env, fakePort, resolv)
	if err != nil {
		rep.skipped = err.Error()
		return rep
	}
	defer off.srv.stop()
	defer on.srv.stop()
	for round := range b.cfg.attrRounds {
		la, _ := loadAvg()
		rep.loads = append(rep.loads, la)
		for _, s := range b.cfg.scenarios {
			if ctx.Err() != nil {
				return rep
			}
			if err := b.attrScenarioRound(ctx, env, &rep, off, on, s, round); err != nil {
				rep.errs = append(rep.errs, fmt.Sprintf("round %d, %s: %v", round+1, s, err))
				fmt.Fprintf(os.Stderr, "benchrun: attribution round %d: %v\n", round+1, err)
			}
		}
	}
	if ctx.Err() == nil {
		rep.egress = b.runEgress(ctx, env, on, &rep)
	}
	return rep
}

// attrAgent is one of the two agents of the attribution runs: it captures
// its own cgroup, where its client runs.
type attrAgent struct {
	srv    *proc
	cgroup string
	admin  int
	prefix []string // runs a client in its cgroup
}

// startAttrAgents starts the agent with --attribution=false and the one with
// attribution on side by side: each captures a cgroup of its own in the same
// namespace and listens on its own port, so their runs can alternate one by
// one while both run (the idle one costs nothing), and warms both up in
// every scenario.
func (b *bench) startAttrAgents(ctx context.Context, env *dpEnv, fakePort int, resolv string) (off, on *attrAgent, err error) {
	onCgroup := env.cgroup + "-attr"
	if err := env.addCgroup(onCgroup); err != nil {
		return nil, nil, err
	}
	agents := make([]*attrAgent, 2)
	for i, attr := range []bool{false, true} {
		cg, port, admin := env.cgroup, b.cfg.basePort+20, b.cfg.basePort+offMeshAdmin
		if attr {
			cg, port, admin = onCgroup, b.cfg.basePort+21, b.cfg.basePort+offMeshAdmin+1
		}
		name := fmt.Sprintf("attr-%v", attr)
		spec := dpAgent{mode: "ebpf", name: name, cgroup: cg, pins: filepath.Join(env.bpffs, name), state: filepath.Join(env.dir, "state-"+name),
			port: port, admin: admin, extra: []string{"--attribution=" + strconv.FormatBool(attr)}}
		srv, err := b.startDPAgent(ctx, env, fakePort, resolv, spec)
		if err != nil {
			for _, a := range agents[:i] {
				a.srv.stop()
			}
			return nil, nil, err
		}
		agents[i] = &attrAgent{srv: srv, cgroup: cg, admin: admin, prefix: env.prefixIn(cg)}
	}
	for _, a := range agents {
		for _, s := range b.cfg.scenarios {
			warm := b.attrOptions(s)
			warm.Passes = b.cfg.warmPasses
			if w, err := b.dnsperfRunIn(ctx, a.prefix, warm, 0); err != nil || w.res.Completed == 0 || w.res.Lost*100 > w.res.Sent {
				agents[0].srv.stop()
				agents[1].srv.stop()
				return nil, nil, fmt.Errorf("warm-up %s through %s: %v (lost %d of %d): capture not working", s, a.cgroup, err, w.res.Lost, w.res.Sent)
			}
		}
	}
	return agents[0], agents[1], nil
}

func (b *bench) attrOptions(scenario string) dnsperf.Options {
	return dnsperf.Options{Server: dpNameserver, Port: 53, DataFile: b.files[scenario], Clients: b.cfg.clients, Threads: 1, Outstand: b.cfg.outstanding, Timeout: 1}
}

// attrScenarioRound runs every variant once in scenario s, one run right
// after the other; the order alternates with the round (off first, then on
// first), so neither side always follows the other.
func (b *bench) attrScenarioRound(ctx context.Context, env *dpEnv, rep *attrReport, off, on *attrAgent, s string, round int) error {
	order := []int{0, 1, 2, 3} // attrVariants: off, on, on+stuck, on+tap
	if round%2 == 1 {
		order = []int{1, 0, 3, 2}
	}
	for _, i := range order {
		v := attrVariants[i]
		a := on
		if v.name == "off" {
			a = off
		}
		o := b.attrOptions(s)
		o.Duration, o.MaxQPS, o.Verbose = b.cfg.latDuration.Seconds(), b.cfg.latQPS, true
		stopPerf := b.attrPerf(a.srv, fmt.Sprintf("%s-%s-%d", v.name, s, round+1))
		r, err := b.attrRun(ctx, env, a, o, v.tap)
		perf := stopPerf()
		if err != nil {
			return fmt.Errorf("%s: %w", v.name, err)
		}
		r.perf, r.round = perf, round
		rep.add(v.name, s, r)
		extra := ""
		switch v.tap {
		case "read":
			extra = fmt.Sprintf("  tap records %d lost %d", r.records, r.lost)
		case "stuck":
			extra = fmt.Sprintf("  VmRSS %.1f -> %.1f -> %.1f MB, VmHWM %.1f -> %.1f -> %.1f MB", mb(r.memBefore.RSS), mb(r.memSubscribed.RSS), mb(r.memAfter.RSS),
				mb(r.memBefore.HWM), mb(r.memSubscribed.HWM), mb(r.memAfter.HWM))
		}
		fmt.Fprintf(os.Stderr, "  attribution %-8s %-5s round %d: p50 %.0f µs  p99 %.0f µs  %5.1f µs/q  lost %d  load %.1f%s\n",
			v.name, s, round+1, p50(&r.run)*1e6, p99(&r.run)*1e6, r.usPerQuery(), r.res.Lost, r.load1, extra)
	}
	return nil
}

// perfSymbols are the functions whose inclusive share of the agent's perf
// samples says what attribution costs: the flow lookup, counting and tap
// publishing (observe), the tap's stream to its client, and the garbage
// collector's background work (for what the tap allocates).
var perfSymbols = []struct{ key, symbol string }{
	{"lookup", "internal/redirect.(*Flows).Lookup"},
	{"observe", "internal/resolver.(*Server).observe"},
	{"stream", "internal/tap.stream"},
	{"gc", "runtime.gcBgMarkWorker"},
}

// attrPerf starts `perf record -g` on srv (with -attribution-perf) into
// -work/perf-NAME.data; the returned func stops it and returns the inclusive
// share (0..1) of the agent's samples in each of perfSymbols, and "samples".
func (b *bench) attrPerf(srv *proc, name string) func() map[string]float64 {
	if !b.cfg.attrPerf {
		return func() map[string]float64 { return nil }
	}
	out := filepath.Join(b.cfg.work, "perf-"+name+".data")
	cmd := exec.Command("perf", "record", "-q", "-g", "-F", "2999", "-p", strconv.Itoa(srv.pid()), "-o", out)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "benchrun: perf:", err)
		return func() map[string]float64 { return nil }
	}
	return func() map[string]float64 {
		_ = cmd.Process.Signal(syscall.SIGINT)
		_ = cmd.Wait()
		rep, err := exec.Command("perf", "report", "--children", "--sort", "sym", "-g", "none", "--stdio", "-i", out).Output()
		if err != nil {
			fmt.Fprintln(os.Stderr, "benchrun: perf report:", err)
			return nil
		}
		return perfShares(string(rep))
	}
}

// perfShares reads perf report --children --stdio output: the inclusive
// share of each of perfSymbols, and the sample count.
func perfShares(rep string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(rep, "\n") {
		if n, ok := strings.CutPrefix(line, "# Samples: "); ok {
			n = strings.Fields(n)[0] // "3K", "166"
			mult := 1.0
			if k, ok := strings.CutSuffix(n, "K"); ok {
				n, mult = k, 1000
			}
			v, _ := strconv.ParseFloat(n, 64)
			out["samples"] = v * mult
			continue
		}
		f := strings.Fields(line)
		if len(f) < 4 || !strings.HasSuffix(f[0], "%") {
			continue
		}
		sym := f[len(f)-1]
		for _, ps := range perfSymbols {
			if strings.HasSuffix(sym, ps.symbol) {
				v, _ := strconv.ParseFloat(strings.TrimSuffix(f[0], "%"), 64)
				out[ps.key] += v / 100
			}
		}
	}
	return out
}

// attrRun is one fixed-rate run against srv with a tap client of kind tap
// ("", "read" or "stuck") subscribed for its length.
func (b *bench) attrRun(ctx context.Context, env *dpEnv, a *attrAgent, o dnsperf.Options, tap string) (attrRun, error) {
	srv := a.srv
	var out attrRun
	_, out.load1 = loadAvg()
	var client *tapClient
	if tap != "" {
		var err error
		if out.memBefore, err = procstat.Memory(srv.pid()); err != nil {
			return out, err
		}
		url := fmt.Sprintf("http://127.0.0.1:%d/debug/tap", a.admin)
		if client, err = b.startTapClient(env, tap, url); err != nil {
			return out, err
		}
		defer client.stop()
		out.memSubscribed, _ = procstat.Memory(srv.pid())
	}
	r, err := b.dnsperfRunIn(ctx, a.prefix, o, srv.pid())
	if err != nil {
		return out, err
	}
	out.run = r
	if client != nil {
		out.memAfter, _ = procstat.Memory(srv.pid())
		out.records, out.lost = client.stop()
	}
	return out, nil
}

// tapClient is a `benchrun helper tap` process.
type tapClient struct {
	cmd           *exec.Cmd
	out           *bufio.Reader
	stopped       bool
	records, lost int64
}

// startTapClient runs a tap client of mode inside env's namespace on the
// generator's core and waits until it is subscribed.
func (b *bench) startTapClient(env *dpEnv, mode, url string) (*tapClient, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	argv := append(env.nsPrefix(), "taskset", "-c", strconv.Itoa(b.cfg.genCPU), self, "helper", "tap", mode, url)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &tapClient{cmd: cmd, out: bufio.NewReader(stdout)}
	line, err := c.out.ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "subscribed" {
		c.stop()
		return nil, fmt.Errorf("tap client (%s) did not subscribe: %q %v", mode, line, err)
	}
	return c, nil
}

// stop ends the client and returns what it counted (a reading client).
func (c *tapClient) stop() (records, lost int64) {
	if c.stopped {
		return c.records, c.lost
	}
	c.stopped = true
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	rest, _ := io.ReadAll(c.out)
	_ = c.cmd.Wait()
	fmt.Sscanf(strings.TrimSpace(string(rest)), "records %d lost %d", &c.records, &c.lost)
	return c.records, c.lost
}

// egressRun is one sender's run: proto, from the captured cgroup or not.
type egressRun struct {
	proto    string
	captured bool
	round    int
	load1    float64
	packets  uint64
	bytes    uint64
	cpu      time.Duration
	wall     time.Duration
	err      string
}

func (e egressRun) perSecond() float64 {
	if e.wall <= 0 {
		return 0
	}
	if e.proto == "tcp" {
		return float64(e.bytes) / (1 << 20) / e.wall.Seconds()
	}
	return float64(e.packets) / e.wall.Seconds()
}

// cpuPer is the sender's CPU per packet in ns (UDP) or per MiB in µs (TCP).
func (e egressRun) cpuPer() float64 {
	if e.proto == "tcp" {
		if e.bytes == 0 {
			return math.NaN()
		}
		return float64(e.cpu.Microseconds()) / (float64(e.bytes) / (1 << 20))
	}
	if e.packets == 0 {
		return math.NaN()
	}
	return float64(e.cpu.Nanoseconds()) / float64(e.packets)
}

const (
	egressSinkNet = "192.0.2.1/24" // a veth in the namespace whose peer is down: what is sent there is dropped
	egressUDPIP   = "192.0.2.2"
	egressUDPDst  = egressUDPIP + ":9"
	egressTCPSink = "127.0.0.1:9"
)

// runEgress measures the attribute program on non-DNS traffic (see the top of
// this file) with an attribution agent attached to the captured cgroup.
func (b *bench) runEgress(ctx context.Context, env *dpEnv, on *attrAgent, rep *attrReport) []egressRun {
	fail := func(err error) []egressRun {
		rep.errs = append(rep.errs, "egress: "+err.Error())
		return nil
	}
	// A veth whose peer stays down drops what it is given (after the
	// egress hook); a permanent neighbour entry spares the ARP.
	for _, args := range [][]string{{"-n", env.ns, "link", "add", "mdb-sink", "type", "veth", "peer", "name", "mdb-sink-peer"},
		{"-n", env.ns, "link", "set", "mdb-sink", "up"}, {"-n", env.ns, "addr", "add", egressSinkNet, "dev", "mdb-sink"},
		{"-n", env.ns, "neigh", "replace", egressUDPIP, "lladdr", "02:00:00:00:00:02", "dev", "mdb-sink", "nud", "permanent"}} {
		if err := runCmd("ip", args...); err != nil {
			return fail(err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		return fail(err)
	}
	sinkArgv := append(env.nsPrefix(), "taskset", "-c", strconv.Itoa(b.cfg.genCPU), self, "helper", "sink", egressTCPSink)
	sink := exec.Command(sinkArgv[0], sinkArgv[1:]...)
	sinkOut, _ := sink.StdoutPipe()
	if err := sink.Start(); err != nil {
		return fail(err)
	}
	defer func() { _ = sink.Process.Kill(); _ = sink.Wait() }()
	if l, err := bufio.NewReader(sinkOut).ReadString('\n'); err != nil || strings.TrimSpace(l) != "listening" {
		return fail(fmt.Errorf("tcp sink: %q %v", l, err))
	}
	var out []egressRun
	for round := range b.cfg.attrRounds {
		for _, proto := range []string{"udp", "tcp"} {
			order := []bool{true, false}
			if round%2 == 1 {
				order = []bool{false, true}
			}
			for _, captured := range order {
				if ctx.Err() != nil {
					return out
				}
				e := b.egressSend(env, on, proto, captured, self)
				e.round = round
				out = append(out, e)
				fmt.Fprintf(os.Stderr, "  egress %s captured=%v round %d: %.0f /s  cpu %.1f per  load %.1f %s\n", proto, captured, round+1, e.perSecond(), e.cpuPer(), e.load1, e.err)
			}
		}
	}
	return out
}

// egressSend runs one sender for the fixed-rate duration on the server's core.
func (b *bench) egressSend(env *dpEnv, on *attrAgent, proto string, captured bool, self string) egressRun {
	e := egressRun{proto: proto, captured: captured}
	_, e.load1 = loadAvg()
	cg := env.direct
	if captured {
		cg = on.cgroup
	}
	dst := egressUDPDst
	if proto == "tcp" {
		dst = egressTCPSink
	}
	argv := append(env.prefixIn(cg), "taskset", "-c", strconv.Itoa(b.cfg.serverCPU), self, "helper", "send", proto, dst, b.cfg.latDuration.String())
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		e.err = err.Error()
		return e
	}
	var cpu, wall int64
	if _, err := fmt.Sscanf(strings.TrimSpace(string(out)), "packets %d bytes %d cpu_ns %d wall_ns %d", &e.packets, &e.bytes, &cpu, &wall); err != nil {
		e.err = fmt.Sprintf("helper output %q: %v", out, err)
	}
	e.cpu, e.wall = time.Duration(cpu), time.Duration(wall)
	return e
}

// attrMedian is the median of key over runs.
func attrMedian(runs []attrRun, key func(*attrRun) float64) float64 {
	vs := make([]float64, len(runs))
	for i := range runs {
		vs[i] = key(&runs[i])
	}
	return median(vs)
}

func (b *bench) renderAttribution(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	a := b.attribution
	p("\n## Attribution cost: who asked\n\n")
	if b.cfg.attrRounds == 0 {
		p("Not run (-attribution-rounds 0).\n")
		return
	}
	if a.skipped != "" {
		p("**NOT MEASURED**: %s.\n", a.skipped)
		return
	}
	p("Through the eBPF datapath, as the datapath table: the agent (`--mode ebpf`) and the captured client (dnsperf, to %s:53) in a fresh network namespace. "+
		"An agent with `--attribution=false` and one with attribution on run side by side, each capturing a cgroup of its own, and their clients take turns one run at a time: %d rounds (the order alternates), every scenario at %d QPS for %s; "+
		"the attribution agent runs, per scenario, one run with no tap client, one with a stuck tap client (subscribed to everything, never reading) and one with a tap client reading everything "+
		"(`benchrun helper tap`, on the generator's core). CPU = the agent's µs per query (schedstat), the median over the rounds; every run's value is listed in round order. "+
		"Load = the machine's 1-minute load average when each run started (other engineers' work shares the 2 cores). Load averages at the start of each round: %s.\n\n",
		dpNameserver, b.cfg.attrRounds, b.cfg.latQPS, b.cfg.latDuration, strings.Join(a.loads, "; "))
	p("| variant | scenario | µs/q median | vs off | µs/q of each run | p50 / p99 µs (median) | p99 of each run | load of each run | lost |\n|---|---|---:|---:|---|---|---|---|---:|\n")
	for _, s := range b.cfg.scenarios {
		off := a.runs["off"][s]
		offUSQ := attrMedian(off, func(r *attrRun) float64 { return r.usPerQuery() })
		for _, v := range attrVariants {
			runs := a.runs[v.name][s]
			if len(runs) == 0 {
				continue
			}
			usq := attrMedian(runs, func(r *attrRun) float64 { return r.usPerQuery() })
			var each, p99s, loads []string
			var lost uint64
			for i := range runs {
				each = append(each, fmtF(runs[i].usPerQuery(), 1))
				p99s = append(p99s, fmt.Sprintf("%.0f", p99(&runs[i].run)*1e6))
				loads = append(loads, fmt.Sprintf("%.0f", runs[i].load1))
				lost += runs[i].res.Lost
			}
			ratio := "-"
			if offUSQ > 0 {
				ratio = fmt.Sprintf("%.3f", usq/offUSQ)
			}
			p("| %s | %s | %s | %s | %s | %.0f / %.0f | %s | %s | %d |\n", v.name, scenarioTitle[s], fmtF(usq, 1), ratio, strings.Join(each, ", "),
				attrMedian(runs, func(r *attrRun) float64 { return p50(&r.run) })*1e6, attrMedian(runs, func(r *attrRun) float64 { return p99(&r.run) })*1e6,
				strings.Join(p99s, ", "), strings.Join(loads, ", "), lost)
		}
	}
	b.renderAttrTargets(w)
	b.renderAttrPerf(w)
	b.renderAttrTap(w)
	b.renderEgress(w)
	for _, e := range a.errs {
		p("\n- ERROR: %s\n", e)
	}
}

// renderAttrTargets prints attribution's cost targets, judged per scenario on the
// medians (and, for the pairs, on each round's pair).
func (b *bench) renderAttrTargets(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	a := b.attribution
	usq := func(r *attrRun) float64 { return r.usPerQuery() }
	p("\n### Targets: attribution cost\n\n")
	for _, t := range []struct {
		variant string
		limit   float64
		what    string
	}{{"on", 1.05, "attribution on, no tap client: CPU/query within 5% of off"}, {"on+tap", 1.20, "one tap client reading everything: CPU/query within 20% of off"}} {
		var parts []string
		for _, s := range b.cfg.scenarios {
			off, on := a.runs["off"][s], a.runs[t.variant][s]
			if len(off) == 0 || len(on) == 0 {
				parts = append(parts, scenarioTitle[s]+": not measured")
				continue
			}
			r := attrMedian(on, usq) / attrMedian(off, usq)
			var per []string
			for i := range min(len(on), len(off)) {
				per = append(per, fmt.Sprintf("%.2f", on[i].usPerQuery()/off[i].usPerQuery()))
			}
			parts = append(parts, fmt.Sprintf("%s %s (%.3fx; per round %s)", scenarioTitle[s], verdict(r <= t.limit), r, strings.Join(per, ", ")))
		}
		p("- %s: %s\n", t.what, strings.Join(parts, "; "))
	}
	var parts []string
	for _, s := range b.cfg.scenarios {
		on, stuck := a.runs["on"][s], a.runs["on+stuck"][s]
		if len(on) == 0 || len(stuck) == 0 {
			continue
		}
		var growth []string
		for _, r := range stuck {
			growth = append(growth, fmt.Sprintf("%+.1f", mb(r.memAfter.RSS)-mb(r.memSubscribed.RSS)))
		}
		parts = append(parts, fmt.Sprintf("%s: p99 median %.0f µs stuck vs %.0f µs without (each run: %s vs %s); VmRSS change from the subscription to the end of each stuck run %s MB",
			scenarioTitle[s], attrMedian(stuck, func(r *attrRun) float64 { return p99(&r.run) })*1e6, attrMedian(on, func(r *attrRun) float64 { return p99(&r.run) })*1e6,
			joinRuns(stuck, p99), joinRuns(on, p99), strings.Join(growth, ", ")))
	}
	p("- a stuck tap client: %s\n", strings.Join(parts, "; "))
	p("- 0 allocs per in-table query with no tap client: a Go benchmark, not measured here (`go test -run X -bench 'BenchmarkServe' -benchmem ./internal/resolver/`: BenchmarkServeAttributed/idle_tap)\n")
}

func joinRuns(runs []attrRun, key func(*run) float64) string {
	var out []string
	for i := range runs {
		out = append(out, fmt.Sprintf("%.0f", key(&runs[i].run)*1e6))
	}
	return strings.Join(out, ", ")
}

// renderAttrPerf prints, with -attribution-perf, where the agent's CPU went:
// the share of its samples in attribution's code.
func (b *bench) renderAttrPerf(w *strings.Builder) {
	if !b.cfg.attrPerf {
		return
	}
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	a := b.attribution
	p("\nWhere the agent's CPU went (`perf record -g -F 2999` on the agent during every run above; perf's own cost is in every row's CPU/query): " +
		"the inclusive share of the agent's samples in the flow lookup (`redirect.(*Flows).Lookup`), in counting and tap publishing (`resolver.(*Server).observe`), " +
		"in the tap's stream to its client (`tap.stream`: naming, JSON, the socket writes) and in the garbage collector's background marking; median over the rounds (every run listed). " +
		"attribution = lookup + observe + stream: the share of the agent's CPU that attribution and the tap take, which the machine's load does not change the way it changes CPU/query.\n\n")
	p("| variant | scenario | samples (median) | lookup | observe | stream | gc mark | attribution | attribution of each run |\n|---|---|---:|---:|---:|---:|---:|---:|---|\n")
	pct := func(v float64) string { return fmt.Sprintf("%.2f%%", v*100) }
	for _, s := range b.cfg.scenarios {
		for _, v := range attrVariants {
			runs := a.runs[v.name][s]
			if len(runs) == 0 || runs[0].perf == nil {
				continue
			}
			share := func(key string) func(*attrRun) float64 { return func(r *attrRun) float64 { return r.perf[key] } }
			total := func(r *attrRun) float64 { return r.perf["lookup"] + r.perf["observe"] + r.perf["stream"] }
			var each []string
			for i := range runs {
				each = append(each, pct(total(&runs[i])))
			}
			p("| %s | %s | %.0f | %s | %s | %s | %s | %s | %s |\n", v.name, scenarioTitle[s], attrMedian(runs, share("samples")),
				pct(attrMedian(runs, share("lookup"))), pct(attrMedian(runs, share("observe"))), pct(attrMedian(runs, share("stream"))),
				pct(attrMedian(runs, share("gc"))), pct(attrMedian(runs, total)), strings.Join(each, ", "))
		}
	}
}

// renderAttrTap prints what the tap clients got and the stuck client's memory.
func (b *bench) renderAttrTap(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	a := b.attribution
	p("\nTap clients, per run in round order: the reading client's records received / lost notices' total; the agent's VmRSS and VmHWM (MB) before the stuck client subscribed, once it had (its ring is allocated), and after its run.\n\n")
	p("| scenario | reading client: records / lost | stuck client: VmRSS before -> subscribed -> after | VmHWM before -> subscribed -> after |\n|---|---|---|---|\n")
	for _, s := range b.cfg.scenarios {
		var rd, rss, hwm []string
		for _, r := range a.runs["on+tap"][s] {
			rd = append(rd, fmt.Sprintf("%d / %d", r.records, r.lost))
		}
		for _, r := range a.runs["on+stuck"][s] {
			rss = append(rss, fmt.Sprintf("%.1f -> %.1f -> %.1f", mb(r.memBefore.RSS), mb(r.memSubscribed.RSS), mb(r.memAfter.RSS)))
			hwm = append(hwm, fmt.Sprintf("%.1f -> %.1f -> %.1f", mb(r.memBefore.HWM), mb(r.memSubscribed.HWM), mb(r.memAfter.HWM)))
		}
		p("| %s | %s | %s | %s |\n", scenarioTitle[s], strings.Join(rd, ", "), strings.Join(rss, ", "), strings.Join(hwm, ", "))
	}
}

// renderEgress prints the attribute program's cost on non-DNS traffic.
func (b *bench) renderEgress(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	a := b.attribution
	p("\n### The attribute program (cgroup_skb/egress) on non-DNS traffic\n\n")
	if len(a.egress) == 0 {
		p("Not measured (see the errors below).\n")
		return
	}
	p("An attribution agent attached to the captured cgroup; one sender thread (`benchrun helper send`, on the server's core) in the captured cgroup and one in its uncaptured sibling (no programs) take turns, %s each, %d rounds: "+
		"connected UDP, 64-byte datagrams to a veth whose peer is down (each passes the egress hook, then the veth drops it; the sock_addr programs do not run on a connected socket's sends), and a TCP stream of 64 KiB writes to a sink in the namespace. "+
		"CPU = the sender's own (getrusage), per datagram or per MiB.\n\n", b.cfg.latDuration, b.cfg.attrRounds)
	p("| traffic | sender | rate median | CPU median | rate of each run | CPU of each run | load of each run |\n|---|---|---:|---:|---|---|---|\n")
	for _, proto := range []string{"udp", "tcp"} {
		for _, captured := range []bool{true, false} {
			var rate, cpu []float64
			var rs, cs, ls []string
			for _, e := range a.egress {
				if e.proto != proto || e.captured != captured {
					continue
				}
				if e.err != "" {
					rs = append(rs, "ERROR "+e.err)
					continue
				}
				rate, cpu = append(rate, e.perSecond()), append(cpu, e.cpuPer())
				rs, cs, ls = append(rs, fmt.Sprintf("%.0f", e.perSecond())), append(cs, fmt.Sprintf("%.0f", e.cpuPer())), append(ls, fmt.Sprintf("%.0f", e.load1))
			}
			traffic, unit, cunit := "UDP 64 B", "datagrams/s", "ns/datagram"
			if proto == "tcp" {
				traffic, unit, cunit = "TCP stream", "MiB/s", "µs/MiB"
			}
			who := "uncaptured cgroup (no programs)"
			if captured {
				who = "captured cgroup"
			}
			p("| %s | %s | %s %s | %s %s | %s | %s | %s |\n", traffic, who, fmtF(median(rate), 0), unit, fmtF(median(cpu), 0), cunit,
				strings.Join(rs, ", "), strings.Join(cs, ", "), strings.Join(ls, ", "))
		}
	}
}
