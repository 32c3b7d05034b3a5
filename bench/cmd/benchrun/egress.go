//go:build linux

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
	"github.com/meshdns/meshdns-ebpf/internal/connload"
	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// `benchrun egress` (bench/run.sh egress, make bench-egress): what DNS-gated
// egress costs and whether it loses the race, the setup. In a fresh
// network namespace (newDPEnv) every address of 198.18.0.0/15 is local, with a
// TCP acceptor and a UDP echo on one port (`benchrun helper internet`, which also
// is the agent's upstream: a name with TTL 1 answered with a fresh address of
// 198.18.0.0/16 on every query). Resolve -> connect clients (test/e2e's
// egressload built with glibc and with musl, and goegress) run in a cgroup under
// the agent's captured one, each under `benchrun helper rusage`, in two
// configurations that take turns round by round (a, b, then b, a): (a) the agent
// in eBPF mode without --egress, (b) with --egress and an enforce policy that
// selects the clients' cgroup and allows the name. Reported per configuration:
// connects ok/denied/failed, connect latency after the answer, SYN retransmits,
// and the clients' CPU per connect; (b) also runs connects to never-resolved
// addresses (-x 198.19). Each of the targets is printed with PASS/FAIL.

const (
	egressName       = "fresh.egress.bench"
	egressReadyName  = "ready.egress.bench"
	egressNever      = "198.19"
	egressPort       = 8080
	egressNamesYAML  = "table:\n  " + egressReadyName + ":\n    ips: [\"240.240.0.10\"]\n    registry: Kubernetes\n"
	egressMaxFails   = 5 // FAIL lines kept per run
	egressP99Target  = 1000
	egressCPUTarget  = 1.05
	egressInetPrefix = "198.18.0.0/15"
	egressFresh      = "198.18.0.0/16"
)

// egressConfig is the egress mode's flags.
type egressConfig struct {
	meshBin, work, self      string
	glibc, musl, goClient    string
	cycles, rounds           int
	udpCycles, neverCycles   int
	serverCPU, genCPU, admin int
	port, upPort             int
	agentArgs                string
}

func runEgress(args []string) int {
	var c egressConfig
	fs := flag.NewFlagSet("egress", flag.ExitOnError)
	fs.StringVar(&c.meshBin, "meshdns", "bin/meshdns-ebpf", "the agent binary")
	fs.StringVar(&c.work, "work", filepath.Join(os.TempDir(), "meshdns-bench"), "scratch directory")
	fs.StringVar(&c.glibc, "egressload-glibc", "", "test/e2e/testdata/egressload built with gcc (glibc)")
	fs.StringVar(&c.musl, "egressload-musl", "", "test/e2e/testdata/egressload built with musl-gcc (musl)")
	fs.StringVar(&c.goClient, "goegress", "", "test/e2e/testdata/goegress built")
	fs.IntVar(&c.cycles, "cycles", 10000, "TCP resolve -> connect cycles per configuration, split over the three clients and the rounds")
	fs.IntVar(&c.rounds, "rounds", 4, "rounds: each configuration runs once per round, the order turning each round (a, b, b, a, ...)")
	fs.IntVar(&c.udpCycles, "udp-cycles", 1000, "cycles of the UDP run (musl, connected UDP: one datagram and its echo) per configuration")
	fs.IntVar(&c.neverCycles, "never-cycles", 300, "cycles per client of the never-resolved run in (b)")
	fs.IntVar(&c.serverCPU, "server-cpu", 1, "core the agent is pinned to")
	fs.IntVar(&c.genCPU, "gen-cpu", 0, "core the clients and the internet helper are pinned to")
	fs.StringVar(&c.agentArgs, "agent-args", "--cache-bytes=1", "extra flags of the agent in both configurations, space-separated; the default leaves its answer cache no room, so every query reaches the upstream and every cycle connects to an address no earlier answer named (\"\" keeps the cache: answers from it are granted too, but the address changes about once a second)")
	fs.IntVar(&c.port, "base-port", 25300, "first port used inside the namespace (agent +60, admin +61, upstream +62)")
	_ = fs.Parse(args)
	c.admin, c.upPort = c.port+61, c.port+62
	c.port += 60
	var err error
	if c.self, err = os.Executable(); err == nil {
		err = c.check()
	}
	if err == nil {
		var rep egressReport
		rep, err = egressBench(context.Background(), c)
		printEgress(os.Stdout, c, rep)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchrun egress:", err)
		return 1
	}
	return 0
}

func (c egressConfig) check() error {
	for _, f := range []struct{ flag, path string }{{"meshdns", c.meshBin}, {"egressload-glibc", c.glibc}, {"egressload-musl", c.musl}, {"goegress", c.goClient}} {
		if f.path == "" {
			return fmt.Errorf("-%s is required (bench/run.sh egress builds it)", f.flag)
		}
		if _, err := os.Stat(f.path); err != nil {
			return fmt.Errorf("-%s: %w", f.flag, err)
		}
	}
	if c.cycles < 3*c.rounds || c.rounds < 1 {
		return fmt.Errorf("-cycles %d -rounds %d: want at least one round and one cycle per client and round", c.cycles, c.rounds)
	}
	return nil
}

// connectRun is one client run's SUMMARY and the CPU it used.
type connectRun struct {
	conf, client, proto string
	never               bool
	round               int
	cycles, ok, eperm   int
	failed, retrans     int
	p50, p99, max       int // µs, of the connects that went through
	cpu                 time.Duration
	agentCPU            time.Duration // the agent's CPU during the run (-1: unknown)
	load                string
	fails               []string
}

// egressReport is every run of both configurations.
type egressReport struct {
	runs                []connectRun
	startLoad, endLoad  string
	started, finished   time.Time
	agentArgs, ns, cgrp string
	upQueries           int // queries the upstream answered (-1: unknown)
}

// egressTarget is one of the targets, judged.
type egressTarget struct {
	name, measured string
	ok             bool
}

// sum adds the runs of conf that match.
func (r egressReport) sum(conf string, match func(connectRun) bool) (s connectRun) {
	s.conf = conf
	for _, x := range r.runs {
		if x.conf != conf || !match(x) {
			continue
		}
		s.cycles += x.cycles
		s.ok += x.ok
		s.eperm += x.eperm
		s.failed += x.failed
		s.retrans += x.retrans
		s.cpu += x.cpu
		if x.agentCPU < 0 || s.agentCPU < 0 {
			s.agentCPU = -1 // unknown for one run: unknown in the sum
		} else {
			s.agentCPU += x.agentCPU
		}
		s.p99 = max(s.p99, x.p99)
		s.max = max(s.max, x.max)
	}
	return s
}

func resolvedTCP(x connectRun) bool { return !x.never && x.proto == "tcp" }
func resolved(x connectRun) bool    { return !x.never }
func never(x connectRun) bool       { return x.never }

// cpuPerConnect is the clients' CPU per cycle of the resolved TCP runs of conf.
func (r egressReport) cpuPerConnect(conf string) time.Duration {
	s := r.sum(conf, resolvedTCP)
	if s.cycles == 0 {
		return 0
	}
	return s.cpu / time.Duration(s.cycles)
}

// roundRatios is the clients' CPU per connect of (b) over (a) in each round
// (resolved TCP runs), the spread behind the total's ratio.
func (r egressReport) roundRatios() []float64 {
	var out []float64
	for round := 1; ; round++ {
		in := func(x connectRun) bool { return resolvedTCP(x) && x.round == round }
		a, b := r.sum("a", in), r.sum("b", in)
		if a.cycles == 0 || b.cycles == 0 || a.cpu == 0 {
			return out
		}
		out = append(out, (float64(b.cpu)/float64(b.cycles))/(float64(a.cpu)/float64(a.cycles)))
	}
}

// egressTargets judges the targets on the runs of (b), against (a) for
// the CPU: each needs its runs to have happened.
func egressTargets(r egressReport) []egressTarget {
	b := r.sum("b", resolved)
	bt := r.sum("b", resolvedTCP)
	nv := r.sum("b", never)
	ca, cb := r.cpuPerConnect("a"), r.cpuPerConnect("b")
	t := []egressTarget{
		{name: "0 false denies (connects in (b) to resolved addresses refused)",
			measured: fmt.Sprintf("%d denied of %d cycles (%d failed otherwise)", b.eperm, b.cycles, b.failed),
			ok:       b.cycles > 0 && b.eperm == 0},
		{name: "connect after the answer p99 < 1 ms with no SYN retransmit ((b), TCP)",
			measured: fmt.Sprintf("worst run's p99 %d µs, %d SYN retransmits, %d of %d connected", bt.p99, bt.retrans, bt.ok, bt.cycles),
			ok:       bt.cycles > 0 && bt.ok == bt.cycles && bt.p99 < egressP99Target && bt.retrans == 0},
		{name: "100% of connects to never-resolved addresses denied ((b), -x " + egressNever + ")",
			measured: fmt.Sprintf("%d denied of %d", nv.eperm, nv.cycles),
			ok:       nv.cycles > 0 && nv.eperm == nv.cycles},
	}
	// The hooks' cost for allowed traffic: only when every connect of (a) and
	// (b) went through is the CPU of the same work compared.
	at := r.sum("a", resolvedTCP)
	cpu := egressTarget{name: "clients' CPU per connect (b) within 5% of (a) (TCP, same run)",
		measured: fmt.Sprintf("not measured: (a) connected %d of %d, (b) %d of %d", at.ok, at.cycles, bt.ok, bt.cycles)}
	if ca > 0 && cb > 0 && at.ok == at.cycles && bt.ok == bt.cycles {
		ratio := float64(cb) / float64(ca)
		cpu.measured = fmt.Sprintf("%.1f vs %.1f µs, ratio %.3f", us(cb), us(ca), ratio)
		cpu.ok = ratio <= egressCPUTarget
	}
	return append(t, cpu)
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// egressBench sets up the namespace, the internet and the clients' cgroup, and
// runs the rounds.
func egressBench(ctx context.Context, c egressConfig) (rep egressReport, err error) {
	rep.started, rep.upQueries = time.Now(), -1
	rep.startLoad, _ = loadAvg()
	logDir := filepath.Join(c.work, "logs")
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return rep, err
	}
	env, err := newDPEnv(c.work)
	if err != nil {
		return rep, fmt.Errorf("setup: %w", err)
	}
	defer func() {
		for _, e := range env.cleanup() {
			err = errors.Join(err, fmt.Errorf("cleanup: %s", e))
		}
	}()
	rep.ns = env.ns
	clients := filepath.Join(env.cgroup, "clients")
	if err := env.addCgroup(clients); err != nil {
		return rep, err
	}
	rep.cgrp = clients
	if err := runCmd("ip", "-n", env.ns, "route", "add", "local", egressInetPrefix, "dev", "lo"); err != nil {
		return rep, err
	}
	files := map[string]string{
		"names.yaml":  egressNamesYAML,
		"resolv.conf": "nameserver " + dpNameserver + "\n",
		"policy.yaml": fmt.Sprintf("policies:\n- name: bench\n  cgroup: %s\n  mode: enforce\n  failMode: fail-open\n  egress:\n  - names: [%s]\n", clients, egressName),
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(env.dir, name), []byte(text), 0o644); err != nil {
			return rep, err
		}
	}
	inet, err := start("egress-internet", c.genCPU, append(env.nsPrefix(), c.self, "helper", "internet",
		strconv.Itoa(egressPort), fmt.Sprintf("%s:%d", upstreamIP, c.upPort), egressName, egressFresh), nil, logDir)
	if err != nil {
		return rep, err
	}
	defer inet.stop()
	if err := waitFor(ctx, 10*time.Second, inet, func() bool {
		return netip.MustParsePrefix(egressFresh).Contains(parseAddr(env.digIn(upstreamIP, c.upPort, egressName)))
	}); err != nil {
		return rep, fmt.Errorf("internet helper: %w (log %s)", err, inet.log.Name())
	}
	order := [][]string{{"a", "b"}, {"b", "a"}}
	for round := range c.rounds {
		for _, conf := range order[round%2] {
			runs, args, err := egressRound(ctx, c, env, clients, conf, round, logDir)
			rep.runs = append(rep.runs, runs...)
			if conf == "b" {
				rep.agentArgs = args
			}
			if err != nil {
				return rep, fmt.Errorf("round %d, (%s): %w", round+1, conf, err)
			}
		}
	}
	rep.finished = time.Now()
	rep.endLoad, _ = loadAvg()
	inet.stop() // it prints how many queries it answered as it exits
	if log, err := os.ReadFile(inet.log.Name()); err == nil {
		if m := regexp.MustCompile(`(?m)^queries (\d+)$`).FindSubmatch(log); m != nil {
			rep.upQueries, _ = strconv.Atoi(string(m[1]))
		}
	}
	return rep, nil
}

func parseAddr(s string) netip.Addr {
	a, _ := netip.ParseAddr(s)
	return a
}

// waitFor polls cond until it holds, p exits or d passes.
func waitFor(ctx context.Context, d time.Duration, p *proc, cond func() bool) error {
	deadline := time.Now().Add(d)
	for !cond() {
		if p.exited() || time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("not ready after %s (exited=%v)", d, p.exited())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// egressRound starts the agent of conf, runs each client once (and in (b)
// of the last round the never-resolved runs, in the first round of each the
// UDP run) and stops it.
func egressRound(ctx context.Context, c egressConfig, env *dpEnv, clients, conf string, round int, logDir string) ([]connectRun, string, error) {
	args := []string{c.meshBin, "run", "--mode", "ebpf", "--persist=false",
		"--listen", fmt.Sprintf("%s:%d", dpListenIP, c.port),
		"--upstream", fmt.Sprintf("%s:%d", upstreamIP, c.upPort),
		"--names", filepath.Join(env.dir, "names.yaml"),
		"--admin", fmt.Sprintf("127.0.0.1:%d", c.admin),
		"--resolv-conf", filepath.Join(env.dir, "resolv.conf"),
		"--state-dir", filepath.Join(env.dir, "state-"+conf),
		"--cgroup", env.cgroup, "--nameservers", dpNameserver, "--bpffs", filepath.Join(env.bpffs, conf),
		"--authoritative=true", "--log-level", "warn"}
	args = append(args, strings.Fields(c.agentArgs)...)
	if conf == "b" {
		args = append(args, "--egress", "--egress-policy-file", filepath.Join(env.dir, "policy.yaml"))
	}
	shown := strings.Join(args[1:], " ")
	fmt.Fprintf(os.Stderr, "benchrun egress: round %d (%s): %s\n", round+1, conf, shown)
	agent, err := start(fmt.Sprintf("egress-agent-%s-%d", conf, round+1), c.serverCPU, append(env.nsPrefix(), args...), nil, logDir)
	if err != nil {
		return nil, shown, err
	}
	defer agent.stop()
	ready := func() bool { return env.digIn(dpListenIP, c.port, egressReadyName) == "240.240.0.10" }
	if conf == "b" {
		ready = func() bool {
			return env.digIn(dpListenIP, c.port, egressReadyName) == "240.240.0.10" &&
				egressMetric(c, env, "meshdns_egress_selected_workloads") == 1
		}
	}
	if err := waitFor(ctx, 30*time.Second, agent, ready); err != nil {
		return nil, shown, fmt.Errorf("agent: %w (log %s)", err, agent.log.Name())
	}
	per := (c.cycles + 3*c.rounds - 1) / (3 * c.rounds)
	type job struct {
		client, bin, proto string
		never              bool
		n                  int
	}
	jobs := []job{{"glibc", c.glibc, "tcp", false, per}, {"musl", c.musl, "tcp", false, per}, {"go", c.goClient, "tcp", false, per}}
	if round == 0 && c.udpCycles > 0 {
		jobs = append(jobs, job{"musl", c.musl, "udp", false, c.udpCycles})
	}
	if conf == "b" && round == c.rounds-1 && c.neverCycles > 0 {
		for _, j := range jobs[:3] {
			jobs = append(jobs, job{j.client, j.bin, "tcp", true, c.neverCycles})
		}
	}
	var runs []connectRun
	for _, j := range jobs {
		argv := []string{j.bin, "-n", strconv.Itoa(j.n), "-p", strconv.Itoa(egressPort)}
		if j.proto == "udp" {
			argv = append(argv, "-u")
		}
		if j.never {
			argv = append(argv, "-x", egressNever)
		}
		argv = append(argv, egressName)
		r := connectRun{conf: conf, client: j.client, proto: j.proto, never: j.never, round: round + 1, agentCPU: -1}
		r.load, _ = loadAvg()
		a0, aerr := procstat.CPU(agent.pid())
		out, err := egressClient(ctx, c, env, clients, argv)
		if a1, err := procstat.CPU(agent.pid()); err == nil && aerr == nil {
			r.agentCPU = a1 - a0
		}
		if err == nil {
			err = parseEgressRun(out, &r)
		}
		if err != nil {
			return runs, shown, fmt.Errorf("%s %s: %w", j.client, j.proto, err)
		}
		fmt.Fprintf(os.Stderr, "  (%s) round %d %-5s %s%s: %d cycles ok %d denied %d failed %d retrans %d  p50/p99/max %d/%d/%d µs  cpu %.1f µs/cycle  load %s\n",
			conf, round+1, j.client, j.proto, map[bool]string{true: " never-resolved", false: ""}[j.never], r.cycles, r.ok, r.eperm, r.failed, r.retrans,
			r.p50, r.p99, r.max, us(r.cpu)/float64(max(r.cycles, 1)), r.load)
		runs = append(runs, r)
	}
	return runs, shown, nil
}

// egressMetric reads one unlabelled series from the agent's /metrics (inside
// the namespace, through `benchrun helper get`); -1 when it is not there.
func egressMetric(c egressConfig, env *dpEnv, name string) float64 {
	argv := append(env.nsPrefix(), c.self, "helper", "get", fmt.Sprintf("http://127.0.0.1:%d/metrics", c.admin))
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		return -1
	}
	for line := range strings.SplitSeq(string(out), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}

// egressClient runs argv pinned to the generator's core, in the clients'
// cgroup, in a mount namespace of its own whose /etc/resolv.conf names the
// captured nameserver, in the network namespace, under `benchrun helper
// rusage`; it returns the output (the client's, then the RUSAGE line).
func egressClient(ctx context.Context, c egressConfig, env *dpEnv, clients string, argv []string) (string, error) {
	full := []string{"taskset", "-c", strconv.Itoa(c.genCPU),
		"sh", "-c", `echo $$ > "$0/cgroup.procs" && exec "$@"`, clients,
		"unshare", "-m", "sh", "-c", `mount --bind "$0" /etc/resolv.conf && exec "$@"`, filepath.Join(env.dir, "resolv.conf")}
	full = append(append(append(full, env.nsPrefix()...), c.self, "helper", "rusage"), argv...)
	cctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(cctx, full[0], full[1:]...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// parseEgressRun reads a client's SUMMARY line, its FAIL lines and the
// RUSAGE line of `helper rusage` into r.
func parseEgressRun(out string, r *connectRun) error {
	sum, err := connload.Parse(out, egressMaxFails)
	if err != nil {
		return err
	}
	if !sum.HasRusage {
		return fmt.Errorf("no RUSAGE line in the output:\n%s", out)
	}
	r.cycles, r.ok, r.eperm, r.failed, r.retrans = sum.Cycles, sum.OK, sum.EPERM, sum.Failed, sum.Retrans
	r.p50, r.p99, r.max, r.cpu = sum.P50, sum.P99, sum.Max, sum.CPU
	r.fails = append(r.fails, sum.Fails...)
	return nil
}

// printEgress prints the lane's section of bench/RESULTS.md.
func printEgress(w io.Writer, c egressConfig, r egressReport) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	p("## DNS-gated egress: resolve -> connect through the eBPF datapath, without and with an enforce policy\n\n")
	p("Started %s, load average %s; finished %s, load average %s (2 cores, shared). Network namespace %s; clients in %s, pinned to CPU %d; agent on CPU %d.\n",
		r.started.UTC().Format("2006-01-02 15:04:05 UTC"), r.startLoad, r.finished.UTC().Format("15:04:05 UTC"), r.endLoad, r.ns, r.cgrp, c.genCPU, c.serverCPU)
	p("(a) = the agent without --egress; (b) = `%s`. %d rounds (a, b, then b, a, ...); %d TCP cycles per configuration over glibc, musl and Go; one musl UDP run of %d cycles per configuration; never-resolved: %d cycles per client in (b)'s last round.\n\n",
		r.agentArgs, c.rounds, c.cycles, c.udpCycles, c.neverCycles)
	p("| conf | round | client | proto | cycles | ok | denied | failed | SYN retrans | p50 / p99 / max µs | client CPU µs/cycle | agent CPU µs/cycle | load | first failures |\n|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|\n")
	for _, x := range r.runs {
		proto := x.proto
		if x.never {
			proto += " never-resolved"
		}
		agent := "?"
		if x.agentCPU >= 0 {
			agent = fmt.Sprintf("%.1f", us(x.agentCPU)/float64(max(x.cycles, 1)))
		}
		retrans := strconv.Itoa(x.retrans)
		if x.client == "go" {
			retrans = "-" // Go's net package does not expose TCP_INFO
		}
		p("| %s | %d | %s | %s | %d | %d | %d | %d | %s | %d / %d / %d | %.1f | %s | %s | %s |\n", x.conf, x.round, x.client, proto, x.cycles, x.ok, x.eperm, x.failed, retrans,
			x.p50, x.p99, x.max, us(x.cpu)/float64(max(x.cycles, 1)), agent, x.load, strings.Join(x.fails, "; "))
	}
	p("\nTotals of the TCP runs to resolved addresses (SYN retransmits: glibc and musl; the p99 of all of them together is at most the worst run's).\n")
	p("\n| conf | TCP cycles | ok | denied | failed | SYN retrans | worst run's p99 µs | max µs | client CPU µs/connect | agent CPU µs/connect |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, conf := range []string{"a", "b"} {
		s := r.sum(conf, resolvedTCP)
		agent := "?"
		if s.agentCPU >= 0 && s.cycles > 0 {
			agent = fmt.Sprintf("%.1f", us(s.agentCPU)/float64(s.cycles))
		}
		p("| %s | %d | %d | %d | %d | %d | %d | %d | %.1f | %s |\n", conf, s.cycles, s.ok, s.eperm, s.failed, s.retrans, s.p99, s.max, us(r.cpuPerConnect(conf)), agent)
	}
	var cycles int
	for _, x := range r.runs {
		if !x.never {
			cycles += x.cycles
		}
	}
	p("\nThe upstream answered %d queries for the %d resolve -> connect cycles of both configurations (-1: unknown; one per cycle: each connect went to an address no earlier answer named).\n", r.upQueries, cycles)
	var each []string
	for _, x := range r.roundRatios() {
		each = append(each, fmt.Sprintf("%.3f", x))
	}
	p("\nClients' CPU per connect, (b) / (a), round by round: %s.\n", strings.Join(each, ", "))
	p("\n### Targets\n\n")
	for _, t := range egressTargets(r) {
		p("- %s: %s (%s)\n", t.name, verdict(t.ok), t.measured)
	}
}

// helperInternet is `benchrun helper internet PORT DNSADDR NAME PREFIX`: the
// internet of the egress lane in the calling namespace (every local address
// accepts TCP and echoes UDP on PORT: testenv.ServeInternet) and its
// nameserver on DNSADDR, which answers A for NAME with a fresh address of
// PREFIX on every query, TTL 1, and NXDOMAIN for every other name. It serves
// until SIGTERM.
func helperInternet(port, addr, name, prefix string) error {
	pn, err := strconv.Atoi(port)
	if err != nil {
		return fmt.Errorf("port %q: %w", port, err)
	}
	pfx, err := netip.ParsePrefix(prefix)
	if err != nil || !pfx.Addr().Is4() {
		return fmt.Errorf("prefix %q: want an IPv4 prefix", prefix)
	}
	_, stop, err := testenv.ServeInternet(netip.MustParsePrefix(egressInetPrefix), pn)
	if err != nil {
		return err
	}
	defer stop()
	name = dns.CanonicalName(name)
	var n atomic.Uint32
	base := pfx.Masked().Addr().As4()
	hosts := uint32(1)<<(32-pfx.Bits()) - 2
	respond := func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		m.RecursionAvailable = true
		if len(req.Question) != 1 {
			m.Rcode = dns.RcodeFormatError
			return []*dns.Msg{m}
		}
		q := req.Question[0]
		if dns.CanonicalName(q.Name) != name {
			m.Rcode = dns.RcodeNameError
			m.Ns = []dns.RR{dnsfake.SOA("bench.", 1)}
			return []*dns.Msg{m}
		}
		if q.Qtype == dns.TypeA {
			v := (uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])) + 1 + (n.Add(1)-1)%hosts
			m.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1},
				A: []byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}}}
		}
		return []*dns.Msg{m}
	}
	srv, err := dnsfake.Listen(dnsfake.Config{Addr: addr, Respond: respond, NoRecord: true})
	if err != nil {
		return err
	}
	defer srv.Close()
	fmt.Println("serving")
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	<-term
	fmt.Printf("queries %d\n", srv.Count())
	return nil
}

// helperRusage is `benchrun helper rusage ARGV...`: it runs ARGV with this
// process's stdout and stderr and then prints the CPU the child used (its
// rusage, user + system) as `RUSAGE cpu_ns=N user_ns=N sys_ns=N`.
func helperRusage(argv []string) error {
	if len(argv) == 0 {
		return errors.New("rusage: no command")
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		return err
	}
	ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	if !ok {
		return errors.New("rusage: no rusage from wait4")
	}
	user := ru.Utime.Nano()
	sys := ru.Stime.Nano()
	fmt.Printf("RUSAGE cpu_ns=%d user_ns=%d sys_ns=%d\n", user+sys, user, sys)
	return nil
}
