package node

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
)

// loadRate is the lookups per second of every check under load.
const loadRate = 2000

// loadTargets are the names the load asks, as FQDNs (no search list), with the
// address the agent answers.
func (e *env) loadTargets() []string {
	return []string{
		"web.team-a.svc.cluster.local.=" + e.webIP,
		"db.team-b.svc.cluster.local.=" + e.dbIP,
		serviceEntryHost + ".=" + serviceEntryIP,
		"q%d." + externalZone + ".=" + externalIP,
	}
}

// checkRollout rolls the DaemonSet out under load the way a user does:
// `kubectl rollout restart`, or an image change applied with `kubectl apply -k`
// (docs/kubernetes.md, Upgrade). With delay, the new agent's API connections go
// through the slowed API server, so it needs at least delay to sync. Every
// lookup started from the command until the old pod is gone must be answered by
// an agent: 0 lost, 0 by the original nameserver, 0 from a wrong source.
func (e *env) checkRollout(t *testing.T, kind string, delay time.Duration) {
	if delay > 0 {
		e.slow.delay.Store(int64(delay))
		e.n.SetAPIEndpoint(t, e.slow.port)
		defer func() {
			e.n.SetAPIEndpoint(t, e.n.CP.Port())
			e.slow.delay.Store(0)
		}()
	}
	old := e.waitSettled(t, time.Minute)
	ld := startLoad(t, e.n, loadRate, e.loadTargets())
	from, start := monotonic(), time.Now()
	var out string
	var err error
	next := map[string]string{agentTag: agentTag2, agentTag2: agentTag}[e.tag]
	switch kind {
	case "restart":
		out, err = e.n.Kubectl("-n", agentNS, "rollout", "restart", "ds/meshdns-ebpf")
	case "helm":
		// docs/kubernetes.md's Helm upgrade: helm upgrade --reuse-values with the
		// other tag, then kubectl rollout status (below, as for the others).
		e.runDocumented(t, 1, next)
		e.tag = next
	default:
		ov := overlay(t, e.root, filepath.Join(e.dir, "overlay"), next, e.n.UnifiedRoot)
		if out, err = e.n.Kubectl("apply", "-k", ov); err == nil {
			e.tag = next
		}
	}
	if err != nil {
		ld.stop()
		t.Fatalf("%v\n%s", err, out)
	}
	status, err := e.n.Kubectl("-n", agentNS, "rollout", "status", "ds/meshdns-ebpf", "--timeout=180s")
	if err != nil {
		t.Errorf("kubectl rollout status did not complete: %v\n%s", err, status)
	}
	now := e.waitSettled(t, 3*time.Minute)
	to, took := monotonic(), time.Since(start)
	res := ld.stop()
	tl := res.between(from, to)
	sync, _, how := e.takeover(t, now.Metadata.Name)
	e.rep.add(t, "%s %s -> %s in %v (new agent: %s) under %d lookups/s: %v",
		kind, old.Metadata.Name, now.Metadata.Name, took.Round(time.Millisecond), how, loadRate, tl)
	t.Logf("per client: %s", res.perClient())
	t.Logf("the new agent's log:\n%s", logSummary(e.agentLog(t, now.Metadata.Name), 25))
	if now.Metadata.Name == old.Metadata.Name {
		t.Errorf("the agent pod was not replaced")
	}
	if delay > 0 && sync < 5*time.Second {
		t.Errorf("the new agent served %v after its start: the slowed API server did not make it sync for >= 5 s", sync)
	}
	if tl.lost+tl.original+tl.wrongsrc+tl.wrong > 0 {
		t.Errorf("the rollout was not seamless: %v\n%s", tl, tl.describe(from))
	}
}

// checkDeletePod deletes the agent's pod under load: only lookups in flight at
// the old agent's exit may be lost; later ones are answered by the original
// nameserver (capture off) until the new pod's agent serves.
func (e *env) checkDeletePod(t *testing.T) {
	e.checkDeath(t, "kubectl delete pod", func(p agentPod, pid int) {
		if out, err := e.n.Kubectl("-n", agentNS, "delete", "pod", p.Metadata.Name, "--wait=false"); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
	})
}

// checkKill kills the agent container's process with signal 9: kubelet starts
// it again in the same pod.
func (e *env) checkKill(t *testing.T) {
	e.checkDeath(t, "kill -9 of the agent container", func(p agentPod, pid int) {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
}

func (e *env) checkDeath(t *testing.T, what string, kill func(agentPod, int)) {
	old := e.waitSettled(t, time.Minute)
	pid := e.agentPID(t, old)
	restarts := old.Status.ContainerStatuses[0].RestartCount
	ld := startLoad(t, e.n, loadRate, e.loadTargets())
	from := monotonic()
	kill(old, pid)
	waitFor(t, time.Minute, "the agent process exits", func() bool { return !alive(pid) })
	died, diedAt := monotonic(), time.Now()
	waitFor(t, 3*time.Minute, "an agent serves again", func() bool {
		pods := e.agentPods(t)
		return len(pods) == 1 && pods[0].ready() && (pods[0].Metadata.Name != old.Metadata.Name ||
			pods[0].Status.ContainerStatuses[0].RestartCount > restarts)
	})
	back := e.waitSettled(t, time.Minute)
	to := monotonic()
	res := ld.stop()
	inFlight, after := res.between(from, died), res.between(died, to)
	_, servedAt, how := e.takeover(t, back.Metadata.Name)
	e.rep.add(t, "%s under %d lookups/s: in flight at the exit %d lost; started after it (the next agent served %v after the exit: %s): %d lost, %d answered by the original nameserver, %d from a wrong source, %d wrong",
		what, loadRate, inFlight.lost+inFlight.wrongsrc, servedAt.Sub(diedAt).Round(time.Millisecond), how,
		after.lost, after.original, after.wrongsrc, after.wrong)
	if after.lost+after.wrongsrc+after.wrong > 0 {
		t.Errorf("lookups started after the agent exited failed: %v\n%s", after, after.describe(died))
	}
}

// stopHold is how long a check keeps the agent stopped: the stop is the fault
// under test, and the fail-open delay is read from the load's own record.
const stopHold = 3 * time.Second

// failOpenGoal: lookups started 250 ms or more after the stop succeed (one lost
// at 250 ms fails).
const failOpenGoal = 250 * time.Millisecond

// checkStopped stops the agent (SIGSTOP, or its container's cgroup frozen) under
// rate lookups/s and measures the fail-open delay: the start of the last lookup
// lost after the stop, relative to it. A low rate leaves the agent's socket
// nearly empty when it stops, as on an idle node.
func (e *env) checkStopped(t *testing.T, how string, rate float64) {
	p := e.waitSettled(t, time.Minute)
	pid := e.agentPID(t, p)
	cg := containerCgroup(t, pid)
	ld := startLoad(t, e.n, rate, e.loadTargets())
	resume := e.stopAgent(t, how, pid, cg)
	stopped := monotonic()
	time.Sleep(stopHold) // the fault's duration, not a wait for a condition
	resumed := monotonic()
	resume()
	waitFor(t, time.Minute, "the agent answers again", func() bool {
		out, err := e.n.Kubectl("exec", "-n", "team-a", "glibc", "--", "getent", "ahostsv4", "web.team-a.svc.cluster.local")
		return err == nil && hasField(out, e.webIP)
	})
	res := ld.stop()
	during := res.between(stopped, resumed)
	delay := time.Duration(0)
	if last := res.lastStart("lost", stopped, resumed); last > 0 {
		delay = time.Duration(last - stopped)
	}
	e.rep.add(t, "%s for %v under %.0f lookups/s: fail-open delay %v (last lost lookup's start after the stop; goal < %v); during the stop %d lost, %d answered by the original nameserver, %d from a wrong source",
		how, stopHold, rate, delay.Round(time.Millisecond), failOpenGoal, during.lost, during.original, during.wrongsrc)
	if delay >= failOpenGoal {
		t.Errorf("lookups started up to %v after the stop were lost (goal: none after %v):\n%s",
			delay.Round(time.Millisecond), failOpenGoal, during.describe(stopped))
	}
	// A reply from another address than the one asked is wrong in any state.
	if all := res.between(0, monotonic()); all.wrongsrc > 0 {
		t.Errorf("%d replies came from a wrong source:\n%s", all.wrongsrc, all.describe(stopped))
	}
}

// stopAgent stops pid (SIGSTOP) or freezes its cgroup and returns the resume.
func (e *env) stopAgent(t *testing.T, how string, pid int, cg string) func() {
	t.Helper()
	if how == "sigstop" {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		resume := func() { _ = syscall.Kill(pid, syscall.SIGCONT) }
		t.Cleanup(resume)
		return resume
	}
	freeze := func(v string) error { return os.WriteFile(filepath.Join(cg, "cgroup.freeze"), []byte(v), 0o644) }
	if err := freeze("1"); err != nil {
		t.Fatal(err)
	}
	resume := func() { _ = freeze("0") }
	t.Cleanup(resume)
	waitFor(t, 10*time.Second, "the agent's cgroup frozen", func() bool {
		b, _ := os.ReadFile(filepath.Join(cg, "cgroup.events"))
		return strings.Contains(string(b), "frozen 1")
	})
	return resume
}

// checkUninstall runs docs/kubernetes.md's Uninstall and lists what the agent
// left on the node: pins, attached programs, the node address, rules, state.
// Then the pods resolve through the cluster DNS again.
func (e *env) checkUninstall(t *testing.T) {
	ov := overlay(t, e.root, filepath.Join(e.dir, "overlay"), e.tag, e.n.UnifiedRoot)
	start := time.Now()
	for _, args := range documented(t, e.root, "## Uninstall", ov) {
		if out, err := e.n.Kubectl(append(args, "--timeout=180s")...); err != nil {
			t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	e.checkUninstalled(t, "`kubectl delete -k`", start)
}

// checkUninstalled waits for the agent pods to be gone after what (begun at start)
// and checks that nothing of the agent is left on the node and that the pods
// resolve through the cluster DNS again.
func (e *env) checkUninstalled(t *testing.T, what string, start time.Time) {
	waitFor(t, 2*time.Minute, "no agent pod", func() bool { return len(e.agentPods(t)) == 0 })
	took := time.Since(start)
	left := e.leftovers(t)
	e.rep.add(t, "%s done in %v; left on the node: %s", what, took.Round(time.Millisecond), orNothing(left))
	if len(left) > 0 {
		t.Errorf("uninstall left: %s", strings.Join(left, "; "))
	}
	var viaDNS []string
	for _, c := range e.resolutionCases() {
		if c.name != "web.team-a.svc.cluster.local" {
			continue
		}
		out, err := e.n.Kubectl(append(append([]string{"exec", "-n", c.ns, c.pod, "--"}, c.argv...), c.name)...)
		if err != nil || !hasField(out, nodetest.Marker) {
			t.Errorf("%s after uninstall: want the cluster DNS's %s, got %v:\n%s", c.client, nodetest.Marker, err, out)
			continue
		}
		viaDNS = append(viaDNS, c.client)
	}
	e.rep.add(t, "after uninstall these clients resolve through the cluster DNS (its marker answer): %v", viaDNS)
}

func orNothing(left []string) string {
	if len(left) == 0 {
		return "nothing"
	}
	return strings.Join(left, "; ")
}

var progLine = regexp.MustCompile(`^\s*\d+\s+cgroup_`)

// bpffs lists the node's bpffs, sorted.
func (e *env) bpffs(t *testing.T) []string {
	t.Helper()
	out, err := e.n.Run("find", "/sys/fs/bpf", "-mindepth", "1")
	if err != nil {
		t.Errorf("list the node's bpffs: %v", err)
		return nil
	}
	l := strings.Fields(out)
	slices.Sort(l)
	return l
}

// leftovers lists what of the agent remains on the node.
func (e *env) leftovers(t *testing.T) []string {
	t.Helper()
	var left []string
	var extra []string
	for _, p := range e.bpffs(t) {
		if !slices.Contains(e.bpffsBefore, p) {
			extra = append(extra, p)
		}
	}
	if len(extra) > 0 {
		left = append(left, fmt.Sprintf("%d bpffs entries (%s)", len(extra), firstLines(strings.Join(extra, "\n"), 4)))
	}
	if out, err := e.n.Run("bpftool", "cgroup", "tree", e.n.UnifiedRoot); err != nil {
		t.Errorf("bpftool cgroup tree: %v", err)
	} else if k := countMatching(out, progLine); k > 0 {
		left = append(left, fmt.Sprintf("%d programs attached under the node's cgroup root", k))
	}
	if out, err := e.n.Run("ip", "-o", "addr"); err == nil && strings.Contains(out, "169.254.20.53") {
		left = append(left, "the node address 169.254.20.53")
	}
	if out, err := e.n.Run("ip", "-o", "link"); err == nil && strings.Contains(out, "meshdns") {
		left = append(left, "a meshdns link")
	}
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		if out, err := e.n.Run(save); err == nil && strings.Contains(out, "MESHDNS") {
			left = append(left, save+" has MESHDNS rules")
		}
	}
	if out, err := e.n.Run("find", "/run/meshdns", "-mindepth", "1"); err == nil && strings.TrimSpace(out) != "" {
		left = append(left, "state: "+strings.Join(strings.Fields(out), ", "))
	}
	return left
}

func countMatching(out string, re *regexp.Regexp) int {
	k := 0
	for _, l := range strings.Split(out, "\n") {
		if re.MatchString(l) {
			k++
		}
	}
	return k
}

func firstLines(s string, n int) string {
	l := strings.Split(s, "\n")
	if len(l) > n {
		return strings.Join(l[:n], ", ") + ", ..."
	}
	return strings.Join(l, ", ")
}

// installOnBrokenNode applies the overlay on a node a check has broken, and
// deletes it again when the check ends.
func (e *env) installOnBrokenNode(t *testing.T) {
	t.Helper()
	ov := overlay(t, e.root, filepath.Join(e.dir, "overlay"), e.tag, e.n.UnifiedRoot)
	if out, err := e.n.Kubectl("apply", "-k", ov); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	t.Cleanup(func() {
		if out, err := e.n.Kubectl("delete", "-k", ov, "--timeout=180s"); err != nil {
			t.Errorf("delete -k: %v\n%s", err, out)
		}
	})
}

// checkBPFFSNotShared reproduces the node requirement of docs/kubernetes.md: with
// the node's /sys/fs/bpf a private mount, the DaemonSet's HostToContainer volume
// cannot be made and the pod shows why.
func (e *env) checkBPFFSNotShared(t *testing.T) {
	if _, err := e.n.Run("mount", "--make-private", "/sys/fs/bpf"); err != nil {
		t.Fatal(err)
	}
	e.installOnBrokenNode(t)
	var reason, msg string
	waitFor(t, 2*time.Minute, "the agent pod reports why its container cannot start", func() bool {
		for _, p := range e.agentPods(t) {
			for _, c := range p.Status.ContainerStatuses {
				if w := c.State.Waiting; w != nil && strings.HasPrefix(w.Reason, "CreateContainer") {
					reason, msg = w.Reason, w.Message
					return true
				}
			}
		}
		return false
	})
	e.rep.add(t, "/sys/fs/bpf not shared on the node: the agent pod waits with %s: %s", reason, msg)
	if !strings.Contains(msg, "/sys/fs/bpf") {
		t.Errorf("the pod's message does not name /sys/fs/bpf: %s", msg)
	}
}

// checkBPFFSNotMounted installs the agent on a node whose /sys/fs/bpf is not a
// bpffs (a shared tmpfs there, so the volume itself can be made): the agent,
// without CAP_SYS_ADMIN, cannot mount one, and what it logs about it must name
// /sys/fs/bpf.
func (e *env) checkBPFFSNotMounted(t *testing.T) {
	if _, err := e.n.Run("sh", "-ec", "umount /sys/fs/bpf; mount -t tmpfs -o mode=0700 tmpfs /sys/fs/bpf; mount --make-shared /sys/fs/bpf"); err != nil {
		t.Fatal(err)
	}
	e.installOnBrokenNode(t)
	var said string
	waitFor(t, 2*time.Minute, "the agent logs a warning or error about bpf", func() bool {
		pods := e.agentPods(t)
		if len(pods) != 1 {
			return false
		}
		for _, prev := range []bool{false, true} {
			args := []string{"logs", "-n", agentNS, pods[0].Metadata.Name}
			if prev {
				args = append(args, "--previous")
			}
			out, _ := e.n.Kubectl(args...)
			for _, l := range strings.Split(out, "\n") {
				low := strings.ToLower(l)
				if strings.Contains(low, "bpf") && (strings.Contains(l, `"level":"WARN"`) || strings.Contains(l, `"level":"ERROR"`) || strings.HasPrefix(l, "meshdns-ebpf:")) {
					said = l
					return true
				}
			}
		}
		return false
	})
	e.rep.add(t, "/sys/fs/bpf not a bpffs on the node: the agent says: %s", said)
	if !strings.Contains(said, "/sys/fs/bpf") {
		t.Errorf("the agent's message does not name /sys/fs/bpf: %s", said)
	}
}
