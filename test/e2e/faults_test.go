package e2e

import (
	"net/http"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Under 2,000 lookups per second (glibc, musl, Go; names
// from the table, forwarded names, a 300 ms upstream for a quarter of them):
// 20 overlapped upgrades (a new agent starts beside the running one and takes
// over; then the old one gets SIGTERM) lose nothing, answer nothing wrong and
// send no reply from the wrong source; 20 plain restarts (SIGTERM, then a new
// agent) lose nothing either: while no agent runs, lookups go to the original
// nameserver, which does not know the mesh names (counted and printed).
func TestUpgradeAndRestartUnderLoad(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	n.start("ebpf")
	missBefore := n.mapMiss()
	ld := n.startLoad(pod, 2000)
	origin := monotonic()

	const rounds = 20
	for i := 0; i < rounds; i++ {
		n.upgrade("ebpf")
	}
	upgraded := monotonic()
	missUpgrades := n.mapMiss() - missBefore
	for i := 0; i < rounds; i++ {
		if err := n.signal(syscall.SIGTERM); err != nil {
			t.Fatalf("restart %d: agent exit: %v", i, err)
		}
		n.startNoWait("ebpf")
		n.waitAnswering(n.agent)
	}
	restarted := monotonic()
	res := ld.stop()
	missRestarts := n.mapMiss() - missBefore - missUpgrades

	upFell, upBad := split(res.between(0, upgraded))
	rsFell, rsBad := split(res.between(upgraded, restarted+int64(10*time.Second)))
	secs := float64(restarted-origin) / 1e9
	t.Logf("load: %d lookups in %.1f s (%.0f/s): %d ok, %d wrong, %d NXDOMAIN, %d failed; glibc: %s; musl: %s; go: %s",
		res.sent, secs, float64(res.sent)/secs, res.ok, res.wrong, res.nx, res.failed,
		res.perClient["glibc"], res.perClient["musl"], res.perClient["go"])
	t.Logf("%d overlapped upgrades in %.1f s: %d lost or wrong, %d mesh names answered by the original nameserver, %d replies from the wrong source",
		rounds, float64(upgraded-origin)/1e9, len(upBad), len(upFell), missUpgrades)
	t.Logf("%d plain restarts in %.1f s: %d lost or wrong, %d replies from the wrong source; mesh names answered by the original nameserver while no agent ran: %d (%s)",
		rounds, float64(restarted-upgraded)/1e9, len(rsBad), missRestarts, len(rsFell), byName(rsFell))
	if len(upBad)+len(upFell) > 0 || missUpgrades > 0 {
		t.Errorf("overlapped upgrades: %d lost or wrong, %d fell through, %d wrong-source replies, want 0:\n%s%s",
			len(upBad), len(upFell), missUpgrades, describe(upBad, origin), describe(upFell, origin))
	}
	if len(rsBad) > 0 || missRestarts > 0 {
		t.Errorf("plain restarts: %d lost or wrong, %d wrong-source replies, want 0:\n%s", len(rsBad), missRestarts, describe(rsBad, origin))
	}
	if res.sent < int(1500*secs) {
		t.Errorf("the load sent only %d lookups in %.1f s", res.sent, secs)
	}
}

// kill -9 under load: the only failed lookups are the
// ones in flight at the kill; every lookup started after it is answered by the
// original nameserver, none refused. SIGSTOP for 5 s: the programs notice
// within 250 ms that the frozen agent dequeues nothing, and getent lookups
// started 250 ms after the stop succeed.
func TestKillAndStopUnderLoad(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	n.start("ebpf")
	ld := n.startLoad(pod, 1000)
	n.waitRedirected(1000) // the load is flowing through the agent
	victim := n.agent
	if err := victim.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if ok, _ := victim.Wait(10 * time.Second); !ok {
		t.Fatal("the killed agent did not exit")
	}
	killed := monotonic() // the process and its sockets are gone
	n.agent = nil
	n.orig.Reset()
	// Every lookup from now on goes to the original nameserver: wait for 2,000.
	if !testenv.WaitFor(30*time.Second, func() bool { return len(n.orig.Queries()) >= 2000 }) {
		t.Fatalf("the original nameserver saw only %d queries after the kill", len(n.orig.Queries()))
	}
	res := ld.stop()
	afterKill := len(n.orig.Queries())
	inFlight := 0
	var bad []loadFail
	for _, f := range res.fails {
		switch {
		case f.start < killed:
			inFlight++ // sent to the agent before it died
		case f.what == "nxdomain" && isMesh(f.name):
			// The original nameserver answered: that is the fail-open.
		default:
			bad = append(bad, f)
		}
	}
	t.Logf("kill -9 under 1,000 lookups/s: %d lookups; %d failed, in flight at the kill; %d queries sent after it reached the original nameserver, %d lookups started after it failed",
		res.sent, inFlight, afterKill, len(bad))
	if len(bad) > 0 {
		t.Errorf("lookups started after the kill failed:\n%s", describe(bad, killed))
	}

	// SIGSTOP under load.
	_, _ = n.cli("cleanup", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	n.start("ebpf")
	ld = n.startLoad(pod, 1000)
	n.waitRedirected(500)
	if err := n.agent.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	defer n.agent.Signal(syscall.SIGCONT)
	time.Sleep(time.Until(stopped.Add(250 * time.Millisecond))) // the spec: lookups from 250 ms on
	var took []time.Duration
	for time.Since(stopped) < 4*time.Second {
		start := time.Now()
		out, err := n.client(pod, 1000, "getent", "ahostsv4", extName)
		took = append(took, time.Since(start))
		if err != nil || !strings.Contains(out, extIP) {
			t.Errorf("getent started %v after SIGSTOP failed: %v\n%s", start.Sub(stopped).Round(time.Millisecond), err, out)
		}
	}
	if err := n.agent.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	stalled := hookCounter(t, n, "total", "skip_stalled")
	t.Logf("SIGSTOP under 1,000 lookups/s: %d getent lookups started 250 ms or more after the stop all answered (longest %v); %d redirects skipped as stalled",
		len(took), maxDur(took), stalled)
	if stalled == 0 {
		t.Errorf("no redirect was skipped for the stalled agent")
	}
	// It resumes: capture comes back.
	n.waitAnswering(n.agent)
	ld.stop()
}

func maxDur(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m.Round(time.Millisecond)
}

// An agent running as pid 1 of its own pid namespace
// (a container) killed with SIGKILL leaves state naming pid 1, which is alive
// in every pid namespace; the next agent started the same way starts, and
// cleanup works.
func TestPID1Restart(t *testing.T) {
	n := newNode(t)
	startAsPID1 := func() *agenttest.Process {
		t.Helper()
		p := n.spawnWrapped("ebpf", []string{"unshare", "--pid", "--fork", "--kill-child", "--"})
		n.agent = p
		n.waitAnswering(p)
		return p
	}
	killPID1 := func(p *agenttest.Process) {
		t.Helper()
		st, err := n.state()
		if err != nil || st.PID != 1 {
			t.Fatalf("state file: %+v %v, want pid 1", st, err)
		}
		// unshare's child is pid 1 inside: kill it from outside.
		child := childOf(t, p.Pid())
		if err := syscall.Kill(child, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if ok, _ := p.Wait(10 * time.Second); !ok {
			t.Fatal("unshare did not exit after its child was killed")
		}
		n.agent = nil
	}
	killPID1(startAsPID1())
	t.Logf("agent as pid 1 killed with SIGKILL; starting again the same way")
	killPID1(startAsPID1())
	out, err := n.cli("cleanup", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if err != nil {
		t.Fatalf("cleanup after a pid-1 crash: %v\n%s", err, out)
	}
	t.Logf("cleanup after the pid-1 crash:\n%s", out)
	n.assertClean()
}

// onlyInFlight checks that the only failed lookups started before the agent
// called who died: those it had in flight.
func onlyInFlight(t *testing.T, who string, res loadResult, died int64) {
	t.Helper()
	fell, bad := split(res.between(died, died+int64(time.Hour)))
	inFlight := len(res.fails) - len(fell) - len(bad)
	t.Logf("the %s died mid-handover: %d lookups; %d failed, in flight in it; of those started after its death %d failed and %d fell through",
		who, res.sent, inFlight, len(bad), len(fell))
	if len(bad)+len(fell) > 0 {
		t.Errorf("lookups started after the %s died failed:\n%s%s", who, describe(bad, died), describe(fell, died))
	}
}

// childOf returns the only child of pid.
func childOf(t *testing.T, pid int) int {
	t.Helper()
	var child int
	if !testenv.WaitFor(5*time.Second, func() bool {
		c, err := testenv.Children(pid)
		if err != nil || len(c) != 1 {
			return false
		}
		child = c[0]
		return true
	}) {
		t.Fatalf("pid %d has no single child", pid)
	}
	return child
}

// No false fail-open: 60 s of 2,000 lookups per second
// while CPU hogs at the same priority keep every core busy. The agent is slow
// but keeps dequeuing, so no query falls through to the original nameserver
// and none is lost.
func TestNoFalseFailOpenUnderCPUSaturation(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	n.start("ebpf")
	hogs := startCPUHogs(t)
	stalledBefore := hookCounter(t, n, "total", "skip_stalled")
	noResolverBefore := hookCounter(t, n, "total", "skip_no_resolver")
	n.orig.Reset()
	ld := n.startLoad(pod, 2000)
	start := time.Now()
	// The duration the test is about, asking /healthz every second: a busy
	// agent is live.
	notLive := 0
	for time.Since(start) < 60*time.Second {
		time.Sleep(time.Second) // the pace of the looks at /healthz, over the run's fixed duration
		if code, body := n.httpGet("http://" + adminAddr + "/healthz"); code != http.StatusOK {
			notLive++
			t.Errorf("/healthz %v into the run: %d %s", time.Since(start).Round(time.Second), code, body)
		}
	}
	res := ld.stop()
	el := time.Since(start)
	fell := n.orig.Count(meshName) + n.orig.Count("ratings.default.svc.cluster.local")
	stalled := hookCounter(t, n, "total", "skip_stalled") - stalledBefore
	noResolver := hookCounter(t, n, "total", "skip_no_resolver") - noResolverBefore
	t.Logf("%v of load with %d CPU hogs on %d CPUs: %d lookups (%.0f/s): %d ok, %d wrong, %d NXDOMAIN, %d failed; %d mesh queries reached the original nameserver; redirects skipped as stalled: %d, for no resolver: %d; /healthz not 200: %d times",
		el.Round(time.Second), hogs, runtime.NumCPU(), res.sent, float64(res.sent)/el.Seconds(), res.ok, res.wrong, res.nx, res.failed,
		fell, stalled, noResolver, notLive)
	if fell != 0 || res.failed+res.wrong+res.nx != 0 || stalled != 0 || noResolver != 0 {
		t.Errorf("false fail-open or loss under CPU saturation:\n%s", describe(res.fails, 0))
	}
	if res.sent < int(1500*el.Seconds()) {
		t.Errorf("the load sent only %d lookups in %v", res.sent, el)
	}
}

// A handover interrupted by a crash (docs/design.md, "Upgrades, restarts and
// crashes"). When the successor dies before it serves, the running agent puts
// its programs and state back and serves on; when the running agent dies right
// after handing its descriptors over, the successor serves alone. Either way
// only queries in flight in the process that died are lost, and every lookup
// started after it is answered through capture.
func TestHandoverFaults(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	n.start("ebpf")
	missBefore := n.mapMiss()

	t.Run("successor dies before it serves", func(t *testing.T) {
		ld := n.startLoad(pod, 500)
		old := n.agent
		failing := n.spawn("ebpf", "--x-handover-fault", "successor")
		if ok, err := failing.Wait(20 * time.Second); !ok || err == nil {
			t.Fatalf("the faulty successor did not exit with an error (%v); log:\n%s", err, n.stderr.String())
		}
		died := monotonic()
		if !testenv.WaitFor(5*time.Second, func() bool {
			st, err := n.state()
			return err == nil && st.PID == old.Pid()
		}) {
			t.Fatalf("the running agent did not take its state back")
		}
		n.waitRedirected(200) // still capturing, through the running agent
		onlyInFlight(t, "successor", ld.stop(), died)
		if old.Exited() {
			t.Fatalf("the running agent exited")
		}
	})

	t.Run("predecessor dies after handing over", func(t *testing.T) {
		// The running agent is the one to die: restart it with the fault armed.
		n.upgrade("ebpf", "--x-handover-fault", "predecessor")
		stalledBefore := hookCounter(t, n, "total", "skip_stalled")
		ld := n.startLoad(pod, 500)
		// On a busy node (every CPU taken): no one reads the resolver's
		// sockets from the predecessor's death until the successor serves,
		// and that gap must stay well inside the stall timeout.
		startCPUHogs(t)
		old := n.agent
		next := n.spawn("ebpf")
		if ok, _ := old.Wait(20 * time.Second); !ok {
			t.Fatalf("the predecessor did not die")
		}
		died := monotonic()
		n.agent = next
		if !testenv.WaitFor(10*time.Second, func() bool {
			st, err := n.state()
			return err == nil && st.PID == next.Pid()
		}) || next.Exited() {
			t.Fatalf("the successor did not take over; log:\n%s", n.stderr.String())
		}
		n.waitRedirected(200)
		onlyInFlight(t, "predecessor", ld.stop(), died)
		if stalled := hookCounter(t, n, "total", "skip_stalled") - stalledBefore; stalled != 0 {
			t.Errorf("%d queries passed the resolver by as stalled while the successor started", stalled)
		}
	})
	if miss := n.mapMiss() - missBefore; miss != 0 {
		t.Errorf("%d replies from the wrong source", miss)
	}
}

// In iptables mode SIGTERM drains too: the capture rules go first (new queries
// go to their original nameserver; conntrack entries of answered queries are
// flushed so a reused source port is not captured again), the resolver answers
// what it was already sent, and only then are the zone rules and the entries
// of those flows removed, so their replies still reach the clients translated
// back (a flush first would take the replies of every query in flight). A few
// lookups with a 300 ms upstream around the stop can still be lost (cause not
// found yet; docs/testing.md has the figures seen): the bound is 10.
func TestIptablesStopDrainsUnderLoad(t *testing.T) {
	testenv.RequirePrivileged(t, "iptables-save")
	n := newNode(t)
	pod := n.addLoadPod()
	n.start("iptables")
	ld := n.startLoad(pod, 1000)
	if !testenv.WaitFor(30*time.Second, func() bool { return len(n.orig.Queries()) >= 300 }) {
		t.Fatalf("the load did not reach the upstream")
	}
	stop := monotonic()
	if err := n.signal(syscall.SIGTERM); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	n.orig.Reset()
	if !testenv.WaitFor(30*time.Second, func() bool { return len(n.orig.Queries()) >= 1000 }) {
		t.Fatalf("lookups did not reach the original nameserver after the stop")
	}
	res := ld.stop()
	_, bad := split(res.fails)
	t.Logf("iptables mode, SIGTERM under 1,000 lookups/s (a quarter with a 300 ms upstream): %d lookups, %d lost or wrong",
		res.sent, len(bad))
	if len(bad) > 10 {
		t.Errorf("%d lookups failed across the stop, want at most 10:\n%s", len(bad), describe(bad, stop))
	}
}

// startCPUHogs keeps every CPU busy with a shell loop (at the test's
// priority) until the test ends, and returns how many it started.
func startCPUHogs(t *testing.T) int {
	t.Helper()
	hogs := runtime.NumCPU()
	for i := 0; i < hogs; i++ {
		hog := exec.Command("sh", "-c", "while :; do :; done")
		if err := hog.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = hog.Process.Kill()
			_ = hog.Wait()
		})
	}
	return hogs
}
