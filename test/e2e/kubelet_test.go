package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// shippedPod is what a kubelet acts on in deploy/kubernetes/daemonset.yaml.
type shippedPod struct {
	startup, readiness, liveness *corev1.Probe
	grace                        time.Duration // terminationGracePeriodSeconds
}

func readShippedPod(t *testing.T) shippedPod {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	b, err := os.ReadFile(filepath.Join(filepath.Dir(file), "..", "..", "deploy", "kubernetes", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var ds appsv1.DaemonSet
	if err := yaml.UnmarshalStrict(b, &ds); err != nil {
		t.Fatalf("daemonset.yaml: %v", err)
	}
	spec := ds.Spec.Template.Spec
	c := spec.Containers[0]
	p := shippedPod{startup: c.StartupProbe, readiness: c.ReadinessProbe, liveness: c.LivenessProbe, grace: 30 * time.Second}
	if g := spec.TerminationGracePeriodSeconds; g != nil {
		p.grace = time.Duration(*g) * time.Second
	}
	if p.startup == nil || p.readiness == nil || p.liveness == nil {
		t.Fatalf("daemonset.yaml: the agent container lacks a probe")
	}
	return p
}

// container is an agent run as a container runtime runs one: pid 1 of its own
// pid namespace, in the node's network namespace (hostNetwork), its state dir
// the node's (the /run/meshdns host path), its admin address the node
// address at the shipped port.
type container struct {
	*agenttest.Process
	hostPID int // the agent, seen from the node
}

func (n *node) startContainer(extra ...string) *container {
	n.t.Helper()
	p := n.spawnWrapped("ebpf", []string{"unshare", "--pid", "--fork", "--kill-child", "--"}, append([]string{"--admin", nodeAdmin}, extra...)...)
	return &container{Process: p, hostPID: childOf(n.t, p.Pid())}
}

// signal signals the agent (pid 1 of the container), as a runtime does.
func (c *container) signal(sig syscall.Signal) error { return syscall.Kill(c.hostPID, sig) }

// probe runs p once for container c, as a kubelet does: an exec probe in the
// container's pid and network namespaces (the image's binary is the test's,
// the state dir the node's: the test appends --state-dir), an HTTP probe at
// the pod IP (the node address, hostNetwork) and the probe's port.
func (n *node) probe(p *corev1.Probe, c *container) error {
	timeout := time.Second
	if p.TimeoutSeconds > 0 {
		timeout = time.Duration(p.TimeoutSeconds) * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	switch {
	case p.Exec != nil:
		argv := append([]string{}, p.Exec.Command...)
		if filepath.Base(argv[0]) != "meshdns-ebpf" {
			return fmt.Errorf("exec probe %v: not the agent's binary", argv)
		}
		argv[0] = bins.agent
		argv = append(argv, "--state-dir", n.stateDir)
		args := append([]string{"--target", fmt.Sprint(c.hostPID), "--pid", "--net", "--"}, argv...)
		out, err := exec.CommandContext(ctx, "nsenter", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("exec probe %v: %v: %s", p.Exec.Command, err, strings.TrimSpace(string(out)))
		}
		return nil
	case p.HTTPGet != nil:
		host, _, _ := net.SplitHostPort(nodeAdmin)
		url := fmt.Sprintf("http://%s%s", net.JoinHostPort(host, p.HTTPGet.Port.String()), p.HTTPGet.Path)
		tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var conn net.Conn
			err := n.ns.Do(func() (err error) {
				conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return err
			})
			return conn, err
		}}
		defer tr.CloseIdleConnections()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode < 200 || resp.StatusCode >= 400 {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return nil
	}
	return fmt.Errorf("probe %+v: neither exec nor httpGet", p)
}

// waitProbe runs p for c every 100 ms (more often than a kubelet: more chances
// to pass early) until it passes; it fails the test if c exits or within.
func (n *node) waitProbe(name string, p *corev1.Probe, c *container, within time.Duration) time.Duration {
	n.t.Helper()
	start := time.Now()
	var last error
	var passed time.Duration
	if !testenv.Poll(within, 100*time.Millisecond, func() bool {
		if c.Exited() {
			n.t.Fatalf("the agent (pid %d) exited before its %s probe passed; log:\n%s", c.hostPID, name, n.stderr.String())
		}
		last, passed = n.probe(p, c), time.Since(start)
		return last == nil
	}) {
		n.t.Fatalf("the %s probe of pid %d did not pass within %v: %v", name, c.hostPID, within, last)
	}
	return passed
}

// startReadyContainer starts the node's first agent as a container and
// waits until its startup and readiness probes pass.
func (n *node) startReadyContainer(pod shippedPod) *container {
	n.t.Helper()
	c := n.startContainer()
	n.agent = c.Process
	n.waitProbe("startup", pod.startup, c, 60*time.Second)
	n.waitProbe("readiness", pod.readiness, c, 60*time.Second)
	return c
}

// kubeletUpgrade replaces old by a new container the way a DaemonSet's surge
// rollout does it: the new pod starts beside the old one; once its startup
// and readiness probes pass, the old pod is deleted: SIGTERM, and SIGKILL if
// it is still running after the grace period. It returns the new container
// and how long the new pod took to become ready.
func (n *node) kubeletUpgrade(pod shippedPod, old *container, extra ...string) (*container, time.Duration) {
	n.t.Helper()
	next := n.startContainer(extra...)
	n.agent = next.Process
	ready := n.waitProbe("startup", pod.startup, next, 60*time.Second)
	ready += n.waitProbe("readiness", pod.readiness, next, 60*time.Second)
	if err := old.signal(syscall.SIGTERM); err != nil {
		n.t.Fatalf("SIGTERM the old agent: %v", err)
	}
	if ok, _ := old.Wait(pod.grace); !ok {
		// Where it is stuck: a Go program dumps its goroutines on SIGQUIT.
		fmt.Fprintf(n.stderr, "--- the old agent (pid %d) outlived the grace period: SIGQUIT\n", old.hostPID)
		_ = old.signal(syscall.SIGQUIT)
		if ok, _ := old.Wait(5 * time.Second); !ok {
			_ = old.signal(syscall.SIGKILL)
			old.Wait(10 * time.Second)
		}
		n.t.Errorf("the old agent (pid %d) outlived the grace period %v and was killed", old.hostPID, pod.grace)
	}
	return next, ready
}

// Overlapped upgrades driven the way a kubelet drives a DaemonSet's surge
// rollout, with the probes of the shipped DaemonSet: the old pod is deleted as
// soon as the new one passes them, never later. The two agents share the
// node's admin address (hostNetwork) and state dir, as on a node. Under
// 2,000 lookups/s (glibc, musl, Go): 10 upgrades, then 3 more whose new agent
// needs 5 s to sync its name sources. Each must lose nothing, send no lookup
// to the original nameserver and give no reply from the wrong source: a pod
// must not pass its probes on its predecessor's answers.
func TestKubeletRolloutUnderLoad(t *testing.T) {
	pod := readShippedPod(t)
	n := newNode(t)
	load := n.addLoadPod()
	cur := n.startReadyContainer(pod)
	n.waitAnswering(cur.Process)
	n.orig.Reset()
	missBefore := n.mapMiss()
	ld := n.startLoad(load, 2000)
	origin := monotonic()
	phase := func(what string, rounds int, extra ...string) (int64, int64, uint64) {
		from, miss := monotonic(), n.mapMiss()
		var slowest time.Duration
		for i := 0; i < rounds; i++ {
			var ready time.Duration
			cur, ready = n.kubeletUpgrade(pod, cur, extra...)
			slowest = max(slowest, ready)
		}
		t.Logf("%s: %d upgrades in %.1f s, new pods ready after at most %v", what, rounds, float64(monotonic()-from)/1e9, slowest.Round(time.Millisecond))
		return from, monotonic(), n.mapMiss() - miss
	}
	f1, t1, miss1 := phase("plain", 10)
	f2, t2, miss2 := phase("slow sync (5 s)", 3, "--x-slow-sync", "5s")
	res := ld.stop()
	secs := float64(t2-origin) / 1e9
	t.Logf("load: %d lookups in %.1f s (%.0f/s): %d ok, %d wrong, %d NXDOMAIN, %d failed; glibc: %s; musl: %s; go: %s",
		res.sent, secs, float64(res.sent)/secs, res.ok, res.wrong, res.nx, res.failed,
		res.perClient["glibc"], res.perClient["musl"], res.perClient["go"])
	for _, ph := range []struct {
		name     string
		from, to int64
		miss     uint64
	}{{"plain", f1, t1, miss1}, {"slow sync", f2, t2 + int64(10*time.Second), miss2}} {
		fell, bad := split(res.between(ph.from, ph.to))
		t.Logf("%s upgrades: %d lost or wrong, %d mesh names answered by the original nameserver, %d replies from the wrong source",
			ph.name, len(bad), len(fell), ph.miss)
		if len(bad)+len(fell) > 0 || ph.miss > 0 {
			t.Errorf("%s upgrades: want 0 lost, 0 answered by the original nameserver, 0 from the wrong source:\n%s%s",
				ph.name, describe(bad, origin), describe(fell, origin))
		}
	}
	if miss := n.mapMiss() - missBefore; miss != miss1+miss2 {
		t.Logf("%d wrong-source replies outside the upgrades", miss-miss1-miss2)
	}
	if res.sent < int(1500*secs) {
		t.Errorf("the load sent only %d lookups in %.1f s", res.sent, secs)
	}
}

// The agent pod deleted (kubectl delete pod: SIGTERM, while the DaemonSet
// controller already creates the replacement pod, which starts beside the
// stopping agent) and the agent's container killed with signal 9 (the kubelet
// restarts it at once), under 2,000 lookups/s: only the lookups in flight at
// the signal are lost; every lookup started after it is answered, by the
// original nameserver while no agent serves.
func TestAgentPodDeletedOrKilledUnderLoad(t *testing.T) {
	pod := readShippedPod(t)
	n := newNode(t)
	load := n.addLoadPod()
	cur := n.startReadyContainer(pod)
	missBefore := n.mapMiss()
	for _, tc := range []struct {
		name string
		sig  syscall.Signal
	}{{"delete pod", syscall.SIGTERM}, {"kill -9", syscall.SIGKILL}} {
		ld := n.startLoad(load, 2000)
		n.waitRedirected(1000)
		old := cur
		if err := old.signal(tc.sig); err != nil {
			t.Fatal(err)
		}
		if tc.sig == syscall.SIGKILL {
			// The kubelet restarts a container once it has exited; lookups sent
			// until the process and its sockets are gone were in flight.
			if ok, _ := old.Wait(10 * time.Second); !ok {
				t.Fatal("the killed agent did not exit")
			}
		}
		signalled := monotonic()
		cur = n.startContainer()
		n.agent = cur.Process
		ready := n.waitProbe("readiness", pod.readiness, cur, 60*time.Second)
		if ok, _ := old.Wait(pod.grace); !ok {
			t.Errorf("%s: the old agent outlived the grace period", tc.name)
		}
		n.waitRedirected(1000) // capturing again, through the new agent
		res := ld.stop()
		fell, bad := split(res.between(signalled, monotonic()+int64(time.Hour)))
		inFlight := len(res.between(0, signalled))
		t.Logf("%s: %d lookups; the new pod was ready %v after the signal; %d failed in flight at the signal; of those started after it %d failed and %d mesh names were answered by the original nameserver",
			tc.name, res.sent, ready.Round(time.Millisecond), inFlight, len(bad), len(fell))
		if len(bad) > 0 {
			t.Errorf("%s: lookups started after the signal failed:\n%s", tc.name, describe(bad, signalled))
		}
	}
	if miss := n.mapMiss() - missBefore; miss != 0 {
		t.Errorf("%d replies from the wrong source", miss)
	}
}
