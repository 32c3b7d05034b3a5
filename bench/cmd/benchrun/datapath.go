//go:build linux

package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/dnsperf"
	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// ---------------------------------------------------------------------------
// DATAPATH COMPARISON: the same resolver reached
//   (1) directly: a client in a sibling cgroup without the programs sends to
//       the resolver's listen address,
//   (2) through the eBPF capture: a client in the captured cgroup sends to the
//       nameserver address; (1) and (2) hit the same agent process (--mode
//       ebpf --cgroup CG) and alternate run by run, so machine noise falls on
//       both alike,
//   (3) through iptables REDIRECT with our conntrack zones (agent --mode
//       iptables; the eBPF and the iptables agent take turns, one round each,
//       so that drift in the machine's speed falls on every path alike),
// from clients (dnsperf) in a network namespace and cgroups this run creates.
// Reported: throughput, round trip (p50/p99 at the fixed rate, the median of
// several runs), ratios to the direct path, and the conntrack entries each
// path leaves.
//
// Isolation (never the host's iptables, never the root cgroup, never
// /sys/fs/bpf): everything runs inside one fresh network namespace — the agent,
// its fake upstream and the client — so iptables mode changes only that
// namespace's tables; the captured "nameserver" 169.254.53.253 is a link-local address on
// the namespace's lo with nothing listening on :53, so an uncaptured query
// fails visibly (ICMP port unreachable -> dnsperf losses). The clients join
// fresh cgroups under the cgroup2 mount; the agent pins into a private bpffs
// mount under -work. All of it is removed at the end, also on failure.
// ---------------------------------------------------------------------------

const (
	dpNameserver = "169.254.53.253"
	dpListenIP   = "127.0.0.1"
)

// datapathRow is one path's measurement.
type datapathRow struct {
	path      string // direct, ebpf, iptables
	sat       []run
	fixedRuns []run
	fixed     *run // the fixed-rate run with the median p50 (nil: none)
	conntrack int  // entries in the namespace after the last fixed-rate run (-1 unknown)
	err       string
}

// medianRun returns the run whose key is the median (the lower middle for an
// even count); nil for none.
func medianRun[R any](runs []R, key func(*R) float64) *R {
	if len(runs) == 0 {
		return nil
	}
	idx := make([]int, len(runs))
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(a, b int) int { return cmp.Compare(key(&runs[a]), key(&runs[b])) })
	return &runs[idx[(len(idx)-1)/2]]
}

func p50(r *run) float64 { return r.res.Percentile(0.5) }

// eachRun lists key (in µs) of every run, comma-separated ("-" for none), and
// the queries the runs lost.
func eachRun(runs []run, key func(*run) float64) (list string, lost uint64) {
	if len(runs) == 0 {
		return "-", 0
	}
	vs := make([]string, len(runs))
	for i := range runs {
		lost += runs[i].res.Lost
		vs[i] = fmt.Sprintf("%.0f", key(&runs[i])*1e6)
	}
	return strings.Join(vs, ", "), lost
}
func p99(r *run) float64 { return r.res.Percentile(0.99) }

type datapathReport struct {
	skipped string
	rows    []datapathRow
}

func (d datapathReport) row(path string) *datapathRow {
	for i := range d.rows {
		if d.rows[i].path == path && d.rows[i].err == "" {
			return &d.rows[i]
		}
	}
	return nil
}

func (d datapathReport) verdict() string {
	if d.skipped != "" || len(d.rows) == 0 {
		return "NOT MEASURED (" + d.skipped + ")"
	}
	direct, ebpf, ipt := d.row("direct"), d.row("ebpf"), d.row("iptables")
	var parts []string
	if direct != nil && ebpf != nil && direct.fixed != nil && ebpf.fixed != nil {
		r := ebpf.fixed.res.Percentile(0.5) / direct.fixed.res.Percentile(0.5)
		parts = append(parts, fmt.Sprintf("eBPF round trip within 5%% of direct: %s (p50 ratio %.3f)", verdict(r <= 1.05), r))
	}
	if ebpf != nil && ipt != nil && ebpf.fixed != nil && ipt.fixed != nil {
		e, i := ebpf.fixed.res.Percentile(0.5), ipt.fixed.res.Percentile(0.5)
		parts = append(parts, fmt.Sprintf("eBPF faster than iptables: %s (p50 %.0f vs %.0f µs)", verdict(e < i), e*1e6, i*1e6))
	}
	if len(parts) == 0 {
		return "NOT MEASURED (a path failed; see the datapath table)"
	}
	return strings.Join(parts, "; ")
}

// dpEnv is the namespace, cgroups and bpffs of one datapath run. cgroup is
// captured; direct is its uncaptured sibling.
type dpEnv struct {
	ns, cgroup, direct, bpffs, dir string
	undo                           []func() error
}

func (e *dpEnv) cleanup() []string {
	var errs []string
	for i := len(e.undo) - 1; i >= 0; i-- {
		if err := e.undo[i](); err != nil {
			errs = append(errs, err.Error())
		}
	}
	e.undo = nil
	return errs
}

func runCmd(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func newDPEnv(work string) (*dpEnv, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("needs root (netns, cgroup, bpffs)")
	}
	for _, t := range []string{"ip", "nsenter", "conntrack", "dig"} {
		if _, err := exec.LookPath(t); err != nil {
			return nil, fmt.Errorf("needs %s: %w", t, err)
		}
	}
	var rb [4]byte
	_, _ = rand.Read(rb[:])
	id := hex.EncodeToString(rb[:])
	e := &dpEnv{ns: "mdb-" + id, dir: filepath.Join(work, "datapath-"+id)}
	fail := func(err error) (*dpEnv, error) {
		e.cleanup()
		return nil, err
	}
	if err := os.MkdirAll(e.dir, 0o755); err != nil {
		return nil, err
	}
	e.undo = append(e.undo, func() error { return os.RemoveAll(e.dir) })

	mnt, err := cgroup2.FindMount()
	if err != nil {
		return fail(err)
	}
	e.cgroup = filepath.Join(mnt, "meshdns-bench-"+id)
	e.direct = filepath.Join(mnt, "meshdns-bench-"+id+"-direct")
	for _, cg := range []string{e.cgroup, e.direct} {
		if err := e.addCgroup(cg); err != nil {
			return fail(err)
		}
	}

	if err := runCmd("ip", "netns", "add", e.ns); err != nil {
		return fail(err)
	}
	e.undo = append(e.undo, func() error { return runCmd("ip", "netns", "del", e.ns) })
	for _, args := range [][]string{
		{"-n", e.ns, "link", "set", "lo", "up"},
		{"-n", e.ns, "addr", "add", dpNameserver + "/32", "dev", "lo"},
	} {
		if err := runCmd("ip", args...); err != nil {
			return fail(err)
		}
	}

	e.bpffs = filepath.Join(e.dir, "bpffs")
	if err := os.MkdirAll(e.bpffs, 0o755); err != nil {
		return fail(err)
	}
	if err := syscall.Mount("bpf", e.bpffs, "bpf", 0, ""); err != nil {
		return fail(fmt.Errorf("mount bpffs %s: %w", e.bpffs, err))
	}
	e.undo = append(e.undo, func() error {
		if err := syscall.Unmount(e.bpffs, syscall.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount %s: %w", e.bpffs, err)
		}
		return nil
	})
	return e, nil
}

// addCgroup creates cgroup directory cg, removed at cleanup.
func (e *dpEnv) addCgroup(cg string) error {
	if err := os.Mkdir(cg, 0o755); err != nil {
		return fmt.Errorf("create cgroup: %w", err)
	}
	e.undo = append(e.undo, func() error {
		// dnsperf has exited by now; retry briefly while the kernel reaps it.
		var err error
		for range 50 {
			if err = os.Remove(cg); err == nil || errors.Is(err, os.ErrNotExist) {
				return nil
			}
			time.Sleep(100 * time.Millisecond)
		}
		return fmt.Errorf("remove cgroup %s: %w", cg, err)
	})
	return nil
}

// nsPrefix runs a command inside the network namespace only. nsenter execs (the
// PID stays) and, unlike `ip netns exec`, keeps the mount namespace: ip remounts
// /sys, which hides the cgroup2 mount under /sys/fs/cgroup from the agent.
func (e *dpEnv) nsPrefix() []string {
	return []string{"nsenter", "--net=/var/run/netns/" + e.ns, "--"}
}

// clientPrefix joins the captured client cgroup, then the namespace, then execs.
func (e *dpEnv) clientPrefix() []string { return e.prefixIn(e.cgroup) }

// prefixIn joins cgroup cg, then the namespace, then execs.
func (e *dpEnv) prefixIn(cg string) []string {
	return append([]string{"sh", "-c", `echo $$ > "$0/cgroup.procs" && exec "$@"`, cg}, e.nsPrefix()...)
}

// digIn resolves name A from inside the namespace.
func (e *dpEnv) digIn(ip string, port int, name string) string {
	argv := append(e.nsPrefix(), "dig", "+short", "+time=1", "+tries=1",
		"@"+ip, "-p", strconv.Itoa(port), name, "A")
	out, _ := exec.Command(argv[0], argv[1:]...).Output()
	return strings.TrimSpace(string(out))
}

func (e *dpEnv) conntrackCount() int {
	argv := append(e.nsPrefix(), "conntrack", "-C")
	out, err := exec.Command(argv[0], argv[1:]...).Output()
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		return -1
	}
	return n
}

func (e *dpEnv) conntrackFlush() {
	_ = exec.Command("ip", "netns", "exec", e.ns, "conntrack", "-F").Run()
}

func (b *bench) runDatapath(ctx context.Context) datapathReport {
	if b.cfg.meshSkip != "" {
		return datapathReport{skipped: "needs the agent: " + b.cfg.meshSkip}
	}
	if _, err := os.Stat(b.cfg.meshBin); err != nil {
		return datapathReport{skipped: fmt.Sprintf("needs the agent binary %s", b.cfg.meshBin)}
	}
	env, err := newDPEnv(b.cfg.work)
	if err != nil {
		return datapathReport{skipped: "setup: " + err.Error()}
	}
	defer func() {
		for _, e := range env.cleanup() {
			b.notes = append(b.notes, "datapath cleanup: "+e)
			fmt.Fprintln(os.Stderr, "benchrun: datapath cleanup:", e)
		}
	}()
	up, fakePort, resolv, err := b.startDPUpstream(env)
	if err != nil {
		return datapathReport{skipped: err.Error()}
	}
	defer up.stop()
	rep := datapathReport{rows: []datapathRow{
		{path: "direct", conntrack: -1}, {path: "ebpf", conntrack: -1}, {path: "iptables", conntrack: -1}}}
	port := b.cfg.basePort + 20
	client := func(i int) dpClient {
		c := dpClient{row: &rep.rows[i], target: dpNameserver, port: 53, prefix: env.clientPrefix()}
		if rep.rows[i].path == "direct" {
			c.target, c.port, c.prefix = dpListenIP, port, env.prefixIn(env.direct)
		}
		return c
	}
	// The eBPF agent serves both the direct and the captured client; the
	// iptables agent runs in turn with it, round by round, so that drift in
	// the machine's speed falls on every path alike.
	phases := []struct {
		mode    string
		clients []dpClient
	}{{"ebpf", []dpClient{client(0), client(1)}}, {"iptables", []dpClient{client(2)}}}
	for round := range max(b.cfg.reps, b.cfg.latReps) {
		for _, ph := range phases {
			if ctx.Err() != nil {
				return rep
			}
			b.datapathRound(ctx, env, ph.mode, port, fakePort, resolv, ph.clients, round)
		}
	}
	for i := range rep.rows {
		rep.rows[i].fixed = medianRun(rep.rows[i].fixedRuns, p50)
	}
	if ctx.Err() == nil {
		b.lookups = b.runLookups(ctx, env, port, fakePort, resolv)
	}
	return rep
}

// startDPUpstream starts the fake upstream inside env's namespace and writes
// the agents' resolv.conf; it returns the upstream, its port and that file.
func (b *bench) startDPUpstream(env *dpEnv) (up *proc, port int, resolv string, err error) {
	port = b.cfg.basePort + offUpstream
	up, err = start("dp-fakeupstream", b.cfg.genCPU, append(env.nsPrefix(), b.cfg.fakeBin,
		"-listen", fmt.Sprintf("%s:%d", upstreamIP, port), "-ttl", "300", "-nx", meshdata.NXSuffix+","+meshdata.Zone), nil, b.logDir)
	if err != nil {
		return nil, 0, "", fmt.Errorf("fake upstream: %w", err)
	}
	resolv = filepath.Join(env.dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+dpNameserver+"\n"), 0o644); err != nil {
		up.stop()
		return nil, 0, "", err
	}
	return up, port, resolv, nil
}

// dpClient is one way of reaching the agent.
type dpClient struct {
	row    *datapathRow
	target string
	port   int
	prefix []string
}

// dpAgent is how one agent of the datapath environment runs: mode, the
// cgroup it captures, its listen port, admin port, pins and state (defaults:
// dpAgentIn).
type dpAgent struct {
	mode, name, cgroup, pins, state string
	port, admin                     int
	extra                           []string
}

// dpAgentIn is the usual agent of env: it captures env.cgroup, pins under
// meshdns and keeps its state per mode.
func (b *bench) dpAgentIn(env *dpEnv, mode string, port int, name string, extra ...string) dpAgent {
	return dpAgent{mode: mode, name: name, cgroup: env.cgroup, pins: filepath.Join(env.bpffs, "meshdns"),
		state: filepath.Join(env.dir, "state-"+mode), port: port, admin: b.cfg.basePort + offMeshAdmin, extra: extra}
}

// startDPAgent starts agent a inside env's namespace and waits until it
// answers on its listen address and has had its first heartbeat.
func (b *bench) startDPAgent(ctx context.Context, env *dpEnv, fakePort int, resolv string, a dpAgent) (*proc, error) {
	port, name := a.port, a.name
	args := []string{b.cfg.meshBin, "run", "--mode", a.mode,
		"--listen", fmt.Sprintf("%s:%d", dpListenIP, port),
		"--upstream", fmt.Sprintf("%s:%d", upstreamIP, fakePort),
		"--names", b.path("nametable.json"),
		"--admin", fmt.Sprintf("127.0.0.1:%d", a.admin),
		"--resolv-conf", resolv,
		"--state-dir", a.state,
		"--cgroup", a.cgroup, "--nameservers", dpNameserver, "--bpffs", a.pins}
	args = append(append(args, strings.Fields(b.cfg.meshArgs)...), a.extra...)
	srv, err := start(name, b.cfg.serverCPU, append(env.nsPrefix(), args...), nil, b.logDir)
	if err != nil {
		return nil, err
	}
	svc := b.tab.Services[len(b.tab.Services)-1]
	// Readiness from inside the namespace on the listen address (dig runs
	// outside the client cgroups); capture is judged by the callers' warm-up.
	deadline := time.Now().Add(30 * time.Second)
	for env.digIn(dpListenIP, port, svc.FQDN()) != svc.IP.String() {
		if srv.exited() || time.Now().After(deadline) || ctx.Err() != nil {
			srv.stop()
			return nil, fmt.Errorf("agent not answering on %s:%d (exited=%v); see %s", dpListenIP, port, srv.exited(), srv.log.Name())
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Give the agent its first heartbeat/ready before judging capture.
	time.Sleep(500 * time.Millisecond)
	return srv, nil
}

// datapathRound starts the agent in mode and runs one round for each client
// (warm-up, a saturation run while round < reps, a fixed-rate run while
// round < latReps), alternating the clients. A failure is recorded in the
// client's row, which then takes no further runs.
func (b *bench) datapathRound(ctx context.Context, env *dpEnv, mode string, port, fakePort int, resolv string, clients []dpClient, round int) {
	live := clients[:0:0]
	for _, c := range clients {
		if c.row.err == "" {
			live = append(live, c)
		}
	}
	if len(live) == 0 {
		return
	}
	fail := func(err string) {
		for _, c := range live {
			c.row.err = err
		}
		fmt.Fprintf(os.Stderr, "benchrun: datapath %s: %s\n", mode, err)
	}
	fmt.Fprintf(os.Stderr, "benchrun: datapath round %d: agent --mode %s in netns %s\n", round+1, mode, env.ns)
	env.conntrackFlush()
	srv, err := b.startDPAgent(ctx, env, fakePort, resolv, b.dpAgentIn(env, mode, port, fmt.Sprintf("dp-%s-%d", mode, round+1)))
	if err != nil {
		fail(err.Error())
		return
	}
	defer srv.stop()
	opts := func(c dpClient) dnsperf.Options {
		return dnsperf.Options{Server: c.target, Port: c.port, DataFile: b.files["table"], Clients: b.cfg.clients, Threads: 1, Outstand: b.cfg.outstanding, Timeout: 1}
	}
	for _, c := range live {
		warm := opts(c)
		warm.Passes = b.cfg.warmPasses
		w, err := b.dnsperfRunIn(ctx, c.prefix, warm, 0)
		if err != nil {
			c.row.err = "warm-up: " + err.Error()
			continue
		}
		if w.res.Completed == 0 || w.res.Lost*100 > w.res.Sent {
			c.row.err = fmt.Sprintf("warm-up through %s:%d lost %d of %d queries: capture not working", c.target, c.port, w.res.Lost, w.res.Sent)
		}
	}
	for _, c := range live {
		if c.row.err != "" || round >= b.cfg.reps {
			continue
		}
		o := opts(c)
		o.Duration = b.cfg.duration.Seconds()
		r, err := b.dnsperfRunIn(ctx, c.prefix, o, srv.pid())
		if err != nil {
			c.row.err = fmt.Sprintf("run %d: %v", round+1, err)
			continue
		}
		c.row.sat = append(c.row.sat, r)
		fmt.Fprintf(os.Stderr, "  datapath %-8s run %d: %9.0f qps  server %.2f core  gen %.2f core  lost %d\n", c.row.path, round+1, r.res.QPS, r.serverBusy(), r.genBusy, r.res.Lost)
	}
	for _, c := range live {
		if c.row.err != "" || round >= b.cfg.latReps {
			continue
		}
		env.conntrackFlush()
		o := opts(c)
		o.Duration, o.MaxQPS, o.Verbose = b.cfg.latDuration.Seconds(), b.cfg.latQPS, true
		r, err := b.dnsperfRunIn(ctx, c.prefix, o, srv.pid())
		if err != nil {
			c.row.err = fmt.Sprintf("fixed-rate run %d: %v", round+1, err)
			continue
		}
		c.row.fixedRuns = append(c.row.fixedRuns, r)
		c.row.conntrack = env.conntrackCount()
		fmt.Fprintf(os.Stderr, "  datapath %-8s @%d run %d: p50 %.0f µs  p99 %.0f µs  conntrack %d\n", c.row.path, b.cfg.latQPS, round+1, p50(&r)*1e6, p99(&r)*1e6, c.row.conntrack)
	}
}

func (b *bench) renderDatapath(w *strings.Builder) {
	p := func(format string, a ...any) { fmt.Fprintf(w, format, a...) }
	p("\n## Datapath: direct vs eBPF capture vs iptables REDIRECT + conntrack zones\n\n")
	if !b.cfg.datapath {
		p("Not run (-datapath=false).\n")
		return
	}
	if b.datapath.skipped != "" {
		p("**NOT MEASURED**: %s.\n", b.datapath.skipped)
		return
	}
	p("Agent, fake upstream and clients (dnsperf) inside one fresh network namespace. direct and ebpf are served by the same agent (`--mode ebpf`): "+
		"direct = a client in a sibling cgroup without the programs, to %s:PORT; ebpf = a client in the captured cgroup, to %s:53; their runs alternate. "+
		"iptables = the agent in `--mode iptables`, the captured client to %s:53; the two agents take turns, one saturation and one fixed-rate run per path per turn. "+
		"Saturation %d x %s (median QPS), fixed rate %d QPS for %s x %d: p50 / p99 of the run with the median p50 (all runs' p50s listed). "+
		"Ratios are to the direct path. Conntrack = entries in the namespace after a fixed-rate run (flushed before).\n\n",
		dpListenIP, dpNameserver, dpNameserver, b.cfg.reps, b.cfg.duration, b.cfg.latQPS, b.cfg.latDuration, b.cfg.latReps)
	p("| path | QPS median | QPS vs direct | bound | p50 / p99 µs | p50 vs direct | p50 of each run µs | server µs/q | lost | conntrack entries |\n|---|---:|---:|---|---|---:|---|---:|---:|---:|\n")
	direct := b.datapath.row("direct")
	for _, r := range b.datapath.rows {
		if r.err != "" {
			p("| %s | ERROR: %s | | | | | | | | |\n", r.path, r.err)
			continue
		}
		s := summarize(&scenarioResult{sat: r.sat})
		qr, lr, lat, usq, lost, each := "-", "-", "-", "-", s.lost, "-"
		if direct != nil {
			ds := summarize(&scenarioResult{sat: direct.sat})
			if ds.qps > 0 {
				qr = fmt.Sprintf("%.3f", s.qps/ds.qps)
			}
		}
		if r.fixed != nil {
			lat = fmt.Sprintf("%.0f / %.0f", r.fixed.res.Percentile(0.5)*1e6, r.fixed.res.Percentile(0.99)*1e6)
			usq = fmtF(r.fixed.usPerQuery(), 1)
			var fixedLost uint64
			each, fixedLost = eachRun(r.fixedRuns, p50)
			lost += fixedLost
			if direct != nil && direct.fixed != nil {
				lr = fmt.Sprintf("%.3f", r.fixed.res.Percentile(0.5)/direct.fixed.res.Percentile(0.5))
			}
		}
		ct := "?"
		if r.conntrack >= 0 {
			ct = strconv.Itoa(r.conntrack)
		}
		p("| %s | %s | %s | %s | %s | %s | %s | %s | %d | %s |\n", r.path, fmtQPS(s.qps), qr, s.bound(), lat, lr, each, usq, lost, ct)
	}
}
