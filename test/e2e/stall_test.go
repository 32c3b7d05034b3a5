package e2e

import (
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// stopper stops and resumes the running agent one way.
type stopper struct {
	name   string
	setup  func(n *node) // before the agent starts
	stop   func(n *node) // returns once the agent is stopped
	resume func(n *node)
}

var stoppers = []stopper{
	{
		name:  "sigstop",
		setup: func(*node) {},
		stop: func(n *node) {
			n.t.Helper()
			if err := n.agent.Signal(syscall.SIGSTOP); err != nil {
				n.t.Fatal(err)
			}
			if !testenv.WaitFor(5*time.Second, func() bool { return procState(n.agent.Pid()) == "T" }) {
				n.t.Fatalf("the agent did not stop")
			}
		},
		resume: func(n *node) { _ = n.agent.Signal(syscall.SIGCONT) },
	},
	{
		// The agent alone in a child cgroup that the cgroup v2 freezer freezes,
		// as a container runtime's pause does.
		name:   "freezer",
		setup:  func(n *node) { n.agentCg = n.cg.Child(n.t, "agent") },
		stop:   func(n *node) { n.agentCg.SetFrozen(n.t, true) },
		resume: func(n *node) { n.agentCg.SetFrozen(n.t, false) },
	},
}

// procState is the state letter of /proc/pid/stat ("T": stopped).
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+3 <= len(s) {
		return s[i+2 : i+3]
	}
	return ""
}

// A stopped agent (SIGSTOP, or frozen by the cgroup freezer) is bypassed in
// time for every lookup started 250 ms or more after the stop, whatever its
// clients did before: none asked anything since the agent last answered
// (sparse), or a load of 1,000 lookups/s ran through it (dense). glibc, musl
// and Go lookups started 250, 500, 750 and 1000 ms after the stop are all
// answered (by the original nameserver), and so is every lookup of the load
// started from 250 ms on. The agent resumes capturing when it runs again.
func TestStoppedAgentFailsOpen(t *testing.T) {
	for _, how := range stoppers {
		for _, dense := range []bool{false, true} {
			pattern := "sparse"
			if dense {
				pattern = "dense"
			}
			t.Run(how.name+"/"+pattern, func(t *testing.T) {
				n := newNode(t)
				pod := n.addLoadPod()
				how.setup(n)
				n.start("ebpf")
				var ld *load
				if dense {
					// Enough threads that the load goes on while the lookups sent to
					// the stopped agent wait for their 2 s timeout (dnsload staggers
					// its threads' first lookups over threads/16 intervals: not too
					// many of them).
					ld = n.startLoadClients(pod, 1000, []loadClientSpec{
						{name: "glibc", bin: bins.loadGlibc, share: 0.4, flags: []string{"-t", "160"}},
						{name: "musl", bin: bins.loadMusl, share: 0.3, flags: []string{"-t", "160"}},
						{name: "go", bin: bins.loadGo, share: 0.3, flags: []string{"-t", "512"}},
					})
					n.waitRedirected(500)
				} else if _, err := n.client(pod, 1000, "getent", "ahostsv4", meshName); err != nil {
					t.Fatalf("a lookup through the agent before the stop: %v", err)
				}
				stalledBefore := hookCounter(t, n, "total", "skip_stalled")
				how.stop(n)
				stopped, stoppedMono := time.Now(), monotonic()
				resumed := false
				resume := func() {
					if !resumed {
						how.resume(n)
						resumed = true
					}
				}
				defer resume()
				time.Sleep(time.Until(stopped.Add(250 * time.Millisecond))) // the spec's point in time
				origBefore := len(n.orig.Queries())
				late := lookupRounds(t, n, pod, stopped, []time.Duration{250, 500, 750, 1000})
				toOrig := len(n.orig.Queries()) - origBefore
				resume()
				endMono := monotonic()
				stalled := hookCounter(t, n, "total", "skip_stalled") - stalledBefore
				t.Logf("%s, %s: %d lookups started 250-1000 ms after the stop failed; %d redirects skipped as stalled", how.name, pattern, late, stalled)
				if stalled == 0 {
					t.Errorf("no redirect was skipped for the stopped agent")
				}
				if ld != nil {
					res := ld.stop()
					_, bad := split(res.between(stoppedMono+int64(250*time.Millisecond), endMono))
					t.Logf("load: %d lookups; from 250 ms after the stop until the resume, %d queries reached the original nameserver and %d lookups failed (glibc: %s; musl: %s; go: %s)",
						res.sent, toOrig, len(bad), res.perClient["glibc"], res.perClient["musl"], res.perClient["go"])
					if toOrig < 200 {
						t.Errorf("the load sent only %d queries while the agent was stopped: the dense case proves nothing", toOrig)
					}
					if len(bad) > 0 {
						t.Errorf("load lookups started 250 ms or more after the stop failed:\n%s", describe(bad, stoppedMono))
					}
				}
				n.waitAnswering(n.agent) // capturing again
			})
		}
	}
}

// lookupRounds starts, at each offset (ms) after stopped, one lookup of extName
// each by glibc, musl and Go in pod, at once, and reports the failures (and
// counts them).
func lookupRounds(t *testing.T, n *node, pod *testenv.Netns, stopped time.Time, offsets []time.Duration) int {
	t.Helper()
	clients := [][]string{{"getent", "ahostsv4"}, {bins.musl}, {bins.goresolve}}
	failed := 0
	for _, off := range offsets {
		time.Sleep(time.Until(stopped.Add(off * time.Millisecond))) // the spec's points in time
		var wg sync.WaitGroup
		var mu sync.Mutex
		for _, c := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				start := time.Since(stopped)
				out, err := n.client(pod, 1000, c[0], append(c[1:], extName)...)
				if err != nil || !has(extIP)(out) {
					mu.Lock()
					failed++
					mu.Unlock()
					t.Errorf("%s started %v after the stop, answered %v later: %v %q",
						c[0], start.Round(time.Millisecond), (time.Since(stopped) - start).Round(time.Millisecond), err, out)
				}
			}()
		}
		wg.Wait()
	}
	return failed
}

// No false fail-open for a client that asks rarely either. Between its
// lookups the agent is idle, and the watch clock keeps a watch running from
// its last dequeue: only the watchdog's empty datagrams, read by the
// resolver, keep that watch from going stale. They must get through while
// CPU hogs at the same priority keep every core busy: 20 s of lookups one at
// a time, a pause of 100-400 ms between them, all answered by the agent, and
// /healthz says the idle agent is live after each.
func TestNoFalseFailOpenForSparseClientsUnderCPUSaturation(t *testing.T) {
	n := newNode(t)
	n.start("ebpf")
	hogs := startCPUHogs(t)
	stalledBefore := hookCounter(t, n, "total", "skip_stalled")
	n.orig.Reset()
	start := time.Now()
	lookups, failed := 0, 0
	for i := 0; time.Since(start) < 20*time.Second; i++ {
		time.Sleep(time.Duration(100+(i*37)%300) * time.Millisecond) // the pause is the point: the agent idles
		out, err := n.client(n.pod, 1000, "getent", "ahostsv4", meshName)
		lookups++
		if err != nil || !has(meshIP)(out) {
			failed++
			t.Errorf("lookup %d (%v into the run): %v %q", i, time.Since(start).Round(time.Millisecond), err, out)
		}
		if code, body := n.httpGet("http://" + adminAddr + "/healthz"); code != http.StatusOK {
			t.Errorf("/healthz %v into the run: %d %s (an idle agent is live)", time.Since(start).Round(time.Millisecond), code, body)
		}
	}
	fell := n.orig.Count(meshName)
	stalled := hookCounter(t, n, "total", "skip_stalled") - stalledBefore
	t.Logf("%d sparse lookups in %v with %d CPU hogs on %d CPUs: %d failed, %d reached the original nameserver, %d redirects skipped as stalled",
		lookups, time.Since(start).Round(time.Second), hogs, runtime.NumCPU(), failed, fell, stalled)
	if fell != 0 || stalled != 0 {
		t.Errorf("false fail-open of an idle agent under CPU saturation: %d mesh lookups reached the original nameserver, %d redirects skipped as stalled", fell, stalled)
	}
}
