//go:build linux

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// `benchrun budgets` (bench/run.sh budgets): per-workload upstream budgets, the
// issue's setup. The agent (--mode off, --workload-qps) behind an upstream that
// answers 2,000 qps after 2 ms and drops the rest; a quiet workload (a table name
// and three external names in turn, one query at a time with a 5 ms pause: at most
// 200 qps) alone (baseline), then beside a noisy workload sending 20,000 qps of
// random *.nx.test names through a pod's ndots:5 search path (loaded), in the same
// run. It prints the quiet workload's p99 ratio, its SERVFAIL/REFUSED and
// timeouts, the upstream rate against the budget and the agent's VmHWM ratio, each
// against the target.

// budgetsConfig is the budgets mode's flags.
type budgetsConfig struct {
	meshBin, work       string
	phase, settle       time.Duration
	budget, maxPending  int
	noisyQPS            int
	serverCPU, genCPU   int
	upstreamQPS         int
	upstreamLatency     time.Duration
	quietPause, timeout time.Duration
	agentArgs           string
	heapProfiles        string        // directory for the agent's heap profiles ("" = none)
	rounds              int           // alternating window pairs of the quiet p99
	window              time.Duration // each window's length
	spin                bool          // keep both CPUs from idling (helper spin)
	quietRealtime       bool          // the quiet workload's process at SCHED_FIFO (chrt)
}

const (
	budgetsTable = "productpage.default.svc.cluster.local."
	budgetsYAML  = "table:\n  productpage.default.svc.cluster.local:\n    ips: [\"240.240.0.10\"]\n    registry: Kubernetes\n"
)

// ndots5 is a pod's search path (namespace default) after the name itself is
// not tried first (fewer than 5 dots): three search suffixes, then the name.
var ndots5 = []string{".default.svc.cluster.local.", ".svc.cluster.local.", ".cluster.local.", "."}

// The workloads' source addresses: each its own workload, with a budget of its own.
const noisyAddr, quietAddr = "127.0.0.1", "127.0.0.3"

// noisyName is the noisy workload's i-th query: a random name under nx.test
// through the search path, each name's expansions in turn.
func noisyName(i int) string {
	return fmt.Sprintf("n%d-%d.nx.test%s", i/len(ndots5), rand.Uint32(), ndots5[i%len(ndots5)])
}

func runBudgets(args []string) int {
	var c budgetsConfig
	fs := flag.NewFlagSet("budgets", flag.ExitOnError)
	fs.StringVar(&c.meshBin, "meshdns", "bin/meshdns-ebpf", "the agent binary")
	fs.StringVar(&c.work, "work", filepath.Join(os.TempDir(), "meshdns-bench"), "scratch directory")
	fs.DurationVar(&c.phase, "phase", 20*time.Second, "length of each phase (baseline, loaded)")
	fs.DurationVar(&c.settle, "settle", 3*time.Second, "start of the loaded phase left out of the upstream rate (the budget's burst)")
	fs.IntVar(&c.budget, "budget", 500, "--workload-qps: upstream queries a second per workload")
	fs.IntVar(&c.maxPending, "max-pending", 128, "--workload-max-pending")
	fs.IntVar(&c.noisyQPS, "noisy-qps", 20000, "the noisy workload's rate")
	fs.IntVar(&c.upstreamQPS, "upstream-qps", 2000, "the upstream's cap (queries above it are dropped)")
	fs.DurationVar(&c.upstreamLatency, "upstream-latency", 2*time.Millisecond, "the upstream's latency")
	fs.DurationVar(&c.quietPause, "quiet-pause", 5*time.Millisecond, "the quiet workload's pause between queries (5 ms: at most 200 qps)")
	fs.DurationVar(&c.timeout, "timeout", 2*time.Second, "the quiet workload's timeout per query")
	fs.IntVar(&c.serverCPU, "server-cpu", 1, "core the agent is pinned to")
	fs.IntVar(&c.genCPU, "gen-cpu", 0, "core the load generators and the upstream (this process) are pinned to")
	fs.StringVar(&c.agentArgs, "agent-args", "", "extra flags of the agent, space-separated (e.g. --cache-bytes=1048576)")
	fs.StringVar(&c.heapProfiles, "heap-profiles", "", "save the agent's heap profile at each phase's end into this directory (the agent built with -tags benchpprof; bench/run.sh does with BENCH_PPROF=1)")
	fs.IntVar(&c.rounds, "p99-rounds", 6, "pairs of alternating windows (quiet alone, quiet beside the noisy workload) whose pooled latencies give the quiet p99 target")
	fs.DurationVar(&c.window, "p99-window", 5*time.Second, "length of each p99 window")
	fs.BoolVar(&c.quietRealtime, "quiet-realtime", false, "run the quiet workload's process at real-time priority (chrt --fifo 1), an experiment: it shares its CPU with the noisy sender and the upstream, and its own wake-up behind them adds to the latencies it sees (the p99 target is judged at each answer's arrival in its socket, before that wake-up)")
	fs.BoolVar(&c.spin, "spin", true, "keep the two CPUs from idling with a busy loop at SCHED_IDLE (preempted at once by any other task): a virtual CPU's wake-up from idle then adds nothing to a quiet query's latency, in either condition")
	_ = fs.Parse(args)
	if err := budgets(c); err != nil {
		fmt.Fprintln(os.Stderr, "benchrun budgets:", err)
		return 1
	}
	return 0
}

// budgetPhase is what one phase measured.
type budgetPhase struct {
	quiet   *dnsfake.Probe
	noisy   *dnsfake.Paced
	upRate  float64 // upstream queries a second (after the settle time when loaded)
	upFails float64 // the agent's failed upstream attempts in the phase (each retried)
	agentUp float64 // the agent's upstream attempts a second, same window as upRate
	hwm     uint64  // the agent's VmHWM in the phase (reset at its start)
	loadAvg string
	mem     budgetMem // what the memory is made of (budgetsmem.go)
	profile string    // the heap profile taken at the phase's end, if asked for
}

func budgets(c budgetsConfig) error {
	pinned := pinSelf(c.genCPU)
	if c.spin {
		stopSpin, err := spinCPUs(c.genCPU, c.serverCPU)
		if err != nil {
			return err
		}
		defer stopSpin()
		pinned += fmt.Sprintf("; CPUs %d and %d kept from idling by a SCHED_IDLE busy loop each", c.genCPU, c.serverCPU)
	}
	logDir := filepath.Join(c.work, "logs")
	dir := filepath.Join(c.work, "budgets")
	for _, d := range []string{logDir, dir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	names := filepath.Join(dir, "names.yaml")
	if err := os.WriteFile(names, []byte(budgetsYAML), 0o644); err != nil {
		return err
	}
	up, err := dnsfake.Listen(dnsfake.Config{Addr: upstreamIP + ":0", NoRecord: true,
		Respond: dnsfake.RateLimited(budgetUpstream, c.upstreamQPS, c.upstreamLatency)})
	if err != nil {
		return fmt.Errorf("upstream: %w", err)
	}
	defer up.Close()
	dnsAddr, admin := freeAddr(), freeAddr()
	serverCPU := c.serverCPU
	if onlineCPUs() < 2 {
		serverCPU = 0
	}
	args := []string{c.meshBin, "run", "--mode", "off", "--listen", dnsAddr,
		"--upstream", up.Addr.String(), "--names", names, "--admin", admin, "--state-dir", dir, "--authoritative=true",
		"--log-level", "warn", "--workload-qps", strconv.Itoa(c.budget), "--workload-max-pending", strconv.Itoa(c.maxPending)}
	var env []string
	pprofAddr := ""
	if c.heapProfiles != "" {
		if err := os.MkdirAll(c.heapProfiles, 0o755); err != nil {
			return err
		}
		pprofAddr = freeAddr()
		env = append(env, "MESHDNS_BENCH_PPROF="+pprofAddr)
	}
	agent, err := start("meshdns-budgets", serverCPU, append(args, strings.Fields(c.agentArgs)...), env, logDir)
	if err != nil {
		return err
	}
	defer agent.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, n := range []string{"ext1.example.org.", "ext2.example.org.", "ext3.example.org."} {
		if err := waitAnswer(ctx, agent, dnsAddr, n, netip.MustParseAddr("192.0.2.1")); err != nil {
			return fmt.Errorf("agent: %w (log %s)", err, filepath.Join(logDir, "meshdns-budgets.log"))
		}
	}
	if err := waitAnswer(ctx, agent, dnsAddr, budgetsTable, netip.MustParseAddr("240.240.0.10")); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	server := netip.MustParseAddrPort(dnsAddr)
	quietNames := []string{budgetsTable, "ext1.example.org.", budgetsTable, "ext2.example.org.", budgetsTable, "ext3.example.org."}
	phase := func(noisy bool) (budgetPhase, error) {
		var r budgetPhase
		r.loadAvg, _ = loadAvg()
		if err := os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", agent.pid()), []byte("5"), 0); err != nil {
			return r, fmt.Errorf("reset the agent's VmHWM: %w", err)
		}
		failsBefore := sumMetric(admin, "meshdns_upstream_failures_total")
		gcBefore := sumMetric(admin, "go_gc_duration_seconds_count")
		stop := make(chan struct{})
		memc := sampleMem(agent.pid(), admin, 250*time.Millisecond, 2*time.Second, stop)
		pc := make(chan *dnsfake.Paced, 1)
		if noisy {
			go func() {
				p, err := dnsfake.PacedUDP(server, netip.MustParseAddr(noisyAddr), c.noisyQPS, noisyName, stop)
				if err != nil {
					fmt.Fprintln(os.Stderr, "benchrun budgets: noisy workload:", err)
				}
				pc <- p
			}()
		}
		qc := make(chan *dnsfake.Probe, 1)
		go func() {
			p, err := quietProcess(dnsAddr, quietAddr, quietNames, c.timeout, c.quietPause, c.quietRealtime, stop)
			if err != nil {
				fmt.Fprintln(os.Stderr, "benchrun budgets: quiet workload:", err)
			}
			qc <- p
		}()
		settle := time.Duration(0)
		if noisy {
			settle = min(c.settle, c.phase/2)
		}
		time.Sleep(settle) // the phase's length: the load runs meanwhile
		upBefore, reqBefore, t0 := up.Count(), sumMetric(admin, "meshdns_upstream_requests_total"), time.Now()
		time.Sleep(c.phase - settle)
		el := time.Since(t0).Seconds()
		r.upRate = float64(up.Count()-upBefore) / el
		r.agentUp = (sumMetric(admin, "meshdns_upstream_requests_total") - reqBefore) / el
		name := "baseline"
		if noisy {
			name = "loaded"
		}
		prof, perr := heapProfile(pprofAddr, c.heapProfiles, name) // while the load still runs
		if perr != nil {
			fmt.Fprintln(os.Stderr, "benchrun budgets:", perr)
		}
		r.profile = prof
		close(stop)
		r.mem = <-memc
		r.mem.gcCycles = sumMetric(admin, "go_gc_duration_seconds_count") - gcBefore
		r.quiet = <-qc
		if noisy {
			r.noisy = <-pc
		}
		r.upFails = sumMetric(admin, "meshdns_upstream_failures_total") - failsBefore
		m, err := procstat.Memory(agent.pid())
		if err != nil {
			return r, err
		}
		r.hwm = m.HWM
		if r.quiet == nil || (noisy && r.noisy == nil) {
			return r, fmt.Errorf("a load generator failed")
		}
		return r, nil
	}
	fmt.Fprintf(os.Stderr, "benchrun budgets: baseline (quiet alone), %s\n", c.phase)
	base, err := phase(false)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "benchrun budgets: loaded (quiet beside noisy), %s\n", c.phase)
	loud, err := phase(true)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "benchrun budgets: the quiet p99, %d alternating windows of %s\n", 2*c.rounds, c.window)
	p99, err := quietWindows(c, server, dnsAddr, quietNames)
	if err != nil {
		return err
	}
	if agent.exited() {
		return fmt.Errorf("the agent exited (log %s)", filepath.Join(logDir, "meshdns-budgets.log"))
	}
	endLoad, _ := loadAvg()
	printBudgets(os.Stdout, c, pinned, serverCPU, base, loud, p99, endLoad)
	fmt.Fprintln(os.Stdout)
	printBudgetMem(os.Stdout, base, loud)
	return nil
}

// budgetUpstream answers *.nx.test NXDOMAIN (with an SOA: cacheable) and any
// other name with one A record, 192.0.2.1, TTL 300.
func budgetUpstream(_ string, req *dns.Msg) []*dns.Msg {
	m := new(dns.Msg)
	m.SetReply(req)
	q := req.Question[0]
	if strings.HasSuffix(strings.ToLower(q.Name), ".nx.test.") {
		m.Rcode = dns.RcodeNameError
		m.Ns = []dns.RR{dnsfake.SOA("nx.test.", 60)}
		return []*dns.Msg{m}
	}
	if q.Qtype == dns.TypeA {
		m.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 300}, A: net.IPv4(192, 0, 2, 1)}}
	}
	return []*dns.Msg{m}
}

// pinSelf pins this process to cpu: it re-executes itself under taskset unless it
// already runs on that core alone (run.sh starts it so). It returns how it runs.
func pinSelf(cpu int) string {
	allowed := cpusAllowed()
	if onlineCPUs() < 2 {
		return "not pinned (one CPU): the generators, the upstream and the agent share it"
	}
	if allowed == strconv.Itoa(cpu) {
		return fmt.Sprintf("load generators and upstream (benchrun) on CPU %d", cpu)
	}
	self, err := os.Executable()
	if err == nil {
		if ts, err := exec.LookPath("taskset"); err == nil {
			argv := append([]string{ts, "-c", strconv.Itoa(cpu), self}, os.Args[1:]...)
			err = syscall.Exec(ts, argv, os.Environ())
			fmt.Fprintln(os.Stderr, "benchrun budgets: taskset:", err)
		}
	}
	return fmt.Sprintf("load generators and upstream NOT pinned (CPUs %s)", allowed)
}

// onlineCPUs counts the machine's online CPUs (runtime.NumCPU counts those
// this process may run on: one once pinned).
func onlineCPUs() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return runtime.NumCPU()
	}
	return countCPUs(strings.TrimSpace(string(b)))
}

// sumMetric sums the samples of metric family name on the agent's /metrics (-1 on error).
func sumMetric(admin, name string) float64 {
	resp, err := plainClient.Get("http://" + admin + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, name+" ") || strings.HasPrefix(l, name+"{") {
			if v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64); err == nil {
				sum += v
			}
		}
	}
	return sum
}

// cpusAllowed is this process's Cpus_allowed_list.
func cpusAllowed() string {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return "?"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Cpus_allowed_list:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// freeAddr is a free loopback UDP and TCP port on 127.0.0.1.
func freeAddr() string {
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			continue
		}
		addr := l.Addr().String()
		l.Close()
		if pc, err := net.ListenPacket("udp", addr); err == nil {
			pc.Close()
			return addr
		}
	}
}

// quietPrio says how the quiet workload's process was scheduled.
func quietPrio(realtime bool) string {
	if realtime {
		return ", its process at real-time priority (chrt --fifo 1)"
	}
	return ", its process at normal priority"
}

// budgetTarget is one of the targets, as measured.
type budgetTarget struct {
	name, measured string
	ok             bool
}

// budgetTargets judges the loaded phase against the baseline: the quiet p99 within
// 1.2x (over the alternating windows), no quiet SERVFAIL/REFUSED or timeout, the
// upstream rate within the budget ±5%, VmHWM within 10%.
func budgetTargets(budget int, base, loud budgetPhase, p99 quietP99) []budgetTarget {
	p99Target := quietP99Target(p99)
	lo, hi := float64(budget)*0.95, float64(budget)*1.05
	hwmRatio := float64(loud.hwm) / float64(max(base.hwm, 1))
	return []budgetTarget{
		p99Target,
		{"0 SERVFAIL or timeouts for the quiet workload", fmt.Sprintf("%d SERVFAIL/REFUSED, %d timed out", loud.quiet.Failed+p99.beside.Failed, loud.quiet.Lost+p99.beside.Lost),
			loud.quiet.Failed+loud.quiet.Lost+p99.beside.Failed+p99.beside.Lost == 0},
		{fmt.Sprintf("noisy upstream rate within its budget ±5%% (%.0f-%.0f/s)", lo, hi), fmt.Sprintf("%.0f/s", loud.upRate), loud.upRate >= lo && loud.upRate <= hi},
		{"agent VmHWM within 10% of the baseline", fmt.Sprintf("%.2fx (%.1f vs %.1f MiB)", hwmRatio, float64(loud.hwm)/(1<<20), float64(base.hwm)/(1<<20)), hwmRatio <= 1.10},
	}
}

// quietP99Target judges the quiet p99 beside the noisy workload against its p99
// alone, at each answer's arrival in the quiet workload's socket where the
// kernel stamped it: the agent's work ends there. What the quiet process's own
// wake-up adds after that (its CPU is shared with the 20,000-qps sender and the
// upstream, as no node's pods would share one CPU with a load generator) is
// shown beside it. Without stamps, the latencies the process saw are judged.
func quietP99Target(p99 quietP99) budgetTarget {
	seenA, seenB := p99.alone.Percentile(0.99), p99.beside.Percentile(0.99)
	seen := float64(seenB) / float64(max(seenA, 1))
	us := func(d time.Duration) time.Duration { return d.Round(time.Microsecond) }
	if len(p99.alone.Arrivals) == 0 || len(p99.beside.Arrivals) == 0 {
		return budgetTarget{"quiet p99 within 1.2x of its baseline", fmt.Sprintf("%.2fx (%s vs %s)", seen, us(seenB), us(seenA)), seen <= 1.2}
	}
	atA, atB := p99.alone.ArrivalPercentile(0.99), p99.beside.ArrivalPercentile(0.99)
	at := float64(atB) / float64(max(atA, 1))
	return budgetTarget{"quiet p99 within 1.2x of its baseline (at the answer's arrival in its socket)",
		fmt.Sprintf("%.2fx (%s vs %s; as its process saw them, after its own wake-up: %.2fx, %s vs %s)", at, us(atB), us(atA), seen, us(seenB), us(seenA)), at <= 1.2}
}

func printBudgets(w io.Writer, c budgetsConfig, pinned string, serverCPU int, base, loud budgetPhase, p99 quietP99, endLoad string) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format+"\n", a...) }
	p("Budgets (`bench/run.sh budgets`): agent `--workload-qps %d --workload-max-pending %d%s` on CPU %d; %s. "+
		"Upstream %d qps cap (drops above), %s latency. Quiet: a table name and three external names in turn, %s pause (at most %d qps), %s timeout%s. "+
		"Noisy: %d qps of random `*.nx.test` names through an ndots:5 search path (three search suffixes answered NXDOMAIN from the table's zone, the fourth upstream). "+
		"Each phase %s; the upstream rate of the loaded phase leaves out its first %s (the budget's burst). Load average %s at the start, %s at the end.",
		c.budget, c.maxPending, strings.TrimRight(" "+c.agentArgs, " "), serverCPU, pinned, c.upstreamQPS, c.upstreamLatency, c.quietPause, int(time.Second/c.quietPause), c.timeout, quietPrio(c.quietRealtime),
		c.noisyQPS, c.phase, min(c.settle, c.phase/2), base.loadAvg, endLoad)
	p("")
	p("| phase | quiet answered / SERVFAIL+REFUSED / timed out | quiet p50 | quiet p99 | upstream rate (seen by it / sent by the agent) | failed upstream attempts | agent VmHWM |")
	p("|---|---|---|---|---|---|---|")
	for _, r := range []struct {
		name string
		ph   budgetPhase
	}{{"baseline (quiet alone)", base}, {"loaded (quiet + noisy)", loud}} {
		q := r.ph.quiet
		p("| %s | %d / %d / %d | %s | %s | %.0f/s / %.0f/s | %.0f | %.1f MiB |", r.name, len(q.Latencies), q.Failed, q.Lost,
			q.Percentile(0.5).Round(time.Microsecond), q.Percentile(0.99).Round(time.Microsecond), r.ph.upRate, r.ph.agentUp, r.ph.upFails, float64(r.ph.hwm)/(1<<20))
	}
	p("")
	p("The quiet p99 target is judged over %d alternating windows of %s each (quiet alone, quiet beside the noisy workload; "+
		"the order swapped every round), pooled by condition, so that what the machine does meanwhile falls on both alike:", 2*c.rounds, c.window)
	p("")
	p("| windows | quiet answered / SERVFAIL+REFUSED / timed out | p50 | p99 | over 1 ms | p50 / p99 at the answer's arrival in the socket | by name: p99 (over 1 ms) |")
	p("|---|---|---|---|---|---|---|")
	for _, r := range []struct {
		name string
		q    *dnsfake.Probe
	}{{"quiet alone", p99.alone}, {"beside the noisy workload", p99.beside}} {
		var by []string
		for _, n := range slices.Sorted(maps.Keys(r.q.ByName)) {
			q := r.q.ByName[n]
			by = append(by, fmt.Sprintf("%s %s (%d)", strings.TrimSuffix(n, "."), q.Percentile(0.99).Round(time.Microsecond), q.Over(time.Millisecond)))
		}
		p("| %s | %d / %d / %d | %s | %s | %d | %s / %s | %s |", r.name, len(r.q.Latencies), r.q.Failed, r.q.Lost, r.q.Percentile(0.5).Round(time.Microsecond),
			r.q.Percentile(0.99).Round(time.Microsecond), r.q.Over(time.Millisecond), r.q.ArrivalPercentile(0.5).Round(time.Microsecond),
			r.q.ArrivalPercentile(0.99).Round(time.Microsecond), strings.Join(by, "; "))
	}
	p("")
	p("Noisy workload: sent %d, answers %v.", loud.noisy.Sent, loud.noisy.Answers)
	p("")
	p("| target | measured | |")
	p("|---|---|---|")
	for _, t := range budgetTargets(c.budget, base, loud, p99) {
		v := "**FAIL**"
		if t.ok {
			v = "**pass**"
		}
		p("| %s | %s | %s |", t.name, t.measured, v)
	}
}

// quietProcess runs the quiet workload in a process of its own (`benchrun
// helper quiet`), as another pod of the node would be, until stop is closed,
// and returns what it saw. In the harness's own process its latencies would
// include the harness's scheduling of the noisy sender and the upstream.
func quietProcess(server, local string, names []string, timeout, pause time.Duration, realtime bool, stop <-chan struct{}) (*dnsfake.Probe, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	argv := append([]string{self, "helper", "quiet", server, local, pause.String(), timeout.String()}, names...)
	if realtime {
		argv = append([]string{"chrt", "--fifo", "1"}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the quiet workload: %w", err)
	}
	<-stop
	in.Close()
	if err := cmd.Wait(); err != nil {
		return nil, fmt.Errorf("quiet workload: %w", err)
	}
	var p dnsfake.Probe
	if err := json.Unmarshal(out.Bytes(), &p); err != nil {
		return nil, fmt.Errorf("quiet workload's report: %w", err)
	}
	return &p, nil
}

// helperQuiet is `benchrun helper quiet`: dnsfake.MixProber until stdin
// closes, its probe printed as JSON.
func helperQuiet(server, local, pause, timeout string, names []string) error {
	pd, err := time.ParseDuration(pause)
	if err != nil {
		return err
	}
	td, err := time.ParseDuration(timeout)
	if err != nil {
		return err
	}
	laddr, err := netip.ParseAddr(local)
	if err != nil {
		return err
	}
	stop := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stop)
	}()
	p, err := dnsfake.MixProber(server, laddr, names, td, pd, stop)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(p)
}

// quietP99 is the quiet workload's latencies over the alternating windows.
type quietP99 struct{ alone, beside *dnsfake.Probe }

// quietWindows runs c.rounds pairs of windows, the quiet workload alone and
// beside the noisy one, in turns (the order swapped every round), and pools
// each condition's latencies: the machine's own hiccups, which come and go over
// minutes, fall on both conditions alike instead of on one phase.
func quietWindows(c budgetsConfig, server netip.AddrPort, dnsAddr string, names []string) (quietP99, error) {
	r := quietP99{alone: dnsfake.NewProbe(), beside: dnsfake.NewProbe()}
	for i := range 2 * c.rounds {
		noisy := (i%2 == 1) != (i/2%2 == 1)
		stop := make(chan struct{})
		nc := make(chan error, 1)
		if noisy {
			go func() {
				_, err := dnsfake.PacedUDP(server, netip.MustParseAddr(noisyAddr), c.noisyQPS, noisyName, stop)
				nc <- err
			}()
		}
		time.AfterFunc(c.window, func() { close(stop) })
		q, err := quietProcess(dnsAddr, quietAddr, names, c.timeout, c.quietPause, c.quietRealtime, stop)
		if err != nil {
			return r, err
		}
		if noisy {
			if err := <-nc; err != nil {
				return r, fmt.Errorf("noisy workload: %w", err)
			}
			r.beside.Add(q)
		} else {
			r.alone.Add(q)
		}
	}
	return r, nil
}

// spinCPUs starts a `benchrun helper spin` on each CPU and returns what stops
// them.
func spinCPUs(cpus ...int) (func(), error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var cmds []*exec.Cmd
	stop := func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}
	for _, cpu := range cpus {
		c := exec.Command(self, "helper", "spin", strconv.Itoa(cpu))
		c.Stderr = os.Stderr
		if err := c.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("spin on CPU %d: %w", cpu, err)
		}
		cmds = append(cmds, c)
	}
	return stop, nil
}

// helperSpin is `benchrun helper spin CPU`: a busy loop on CPU at SCHED_IDLE
// until killed.
func helperSpin(cpu string) error {
	n, err := strconv.Atoi(cpu)
	if err != nil {
		return err
	}
	runtime.LockOSThread()
	var set unix.CPUSet
	set.Set(n)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("pin to CPU %d: %w", n, err)
	}
	if err := unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_IDLE}, 0); err != nil {
		return fmt.Errorf("SCHED_IDLE: %w", err)
	}
	for {
	}
}
