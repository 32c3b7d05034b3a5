package node

import (
	"fmt"
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/redirect/socklb"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The agent beside a socket load balancer that was on the node first, as
// Cilium's (kube-proxy replacement) or Calico's connect-time LB is on the
// clusters people run: the tests' own socket LB (internal/redirect/socklb)
// attached at the node's cgroup root before the DaemonSet is applied,
// translating the kube-dns ClusterIP:53 to the stand-in cluster DNS pod:53.
// Each configuration is a fresh install under the same 2,000 lookups/s as the
// rollout checks (UDP: glibc, musl, Go, the raw Go client) plus dig +tcp
// lookups of the ClusterIP, and the documented uninstall after it.

// socketLBConfig is one configuration: the LB's variant and whether the agent
// may order its programs in front of the LB's (else, as on a kernel without
// ordered cgroup programs, it captures the backend the LB translated to).
type socketLBConfig struct {
	name      string
	tcpOnly   bool // Calico's bpfConnectTimeLoadBalancing: TCP
	unordered bool // the agent gets redirect.UnorderedEnv=1
}

// socketLBConfigs: the full LB and the TCP-only one, each with ordering and
// with backend capture.
var socketLBConfigs = []socketLBConfig{
	{name: "Ordering"},
	{name: "BackendCapture", unordered: true},
	{name: "TCPOnlyOrdering", tcpOnly: true},
	{name: "TCPOnlyBackendCapture", tcpOnly: true, unordered: true},
}

// socketLBWindow is how long each configuration's load runs: the measurement
// window, not a wait for anything.
const socketLBWindow = 3 * time.Second

// socketLBTCPLookups is how many dig +tcp lookups of the ClusterIP each
// configuration makes (one dig process, one after another).
const socketLBTCPLookups = 60

// checkSocketLB runs every configuration. It needs the agent uninstalled
// (it runs after Uninstall) and leaves it uninstalled.
func (e *env) checkSocketLB(t *testing.T) {
	backend := podIP(t, e.n, "kube-system", "stand-in-dns")
	for _, c := range socketLBConfigs {
		t.Run(c.name, func(t *testing.T) { e.socketLBCase(t, c, backend) })
	}
}

func (e *env) socketLBCase(t *testing.T, c socketLBConfig, backend string) {
	if left := e.leftovers(t); len(left) > 0 {
		t.Fatalf("the node is not clean before the socket LB: %s", strings.Join(left, "; "))
	}
	svc := netip.AddrPortFrom(netip.MustParseAddr(nodetest.ClusterDNS), 53)
	be := netip.AddrPortFrom(netip.MustParseAddr(backend), 53)
	lb, err := socklb.Attach(e.n.UnifiedRoot, socklb.Options{Services: map[netip.AddrPort]netip.AddrPort{svc: be}, TCPOnly: c.tcpOnly})
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, so it runs last: after the agent's uninstall.
	t.Cleanup(func() {
		if err := lb.Close(); err != nil {
			t.Errorf("detach the socket LB: %v", err)
		}
		if left := e.leftovers(t); len(left) > 0 {
			t.Errorf("left on the node after the uninstall and the LB's detach: %s", strings.Join(left, "; "))
		}
	})
	lbKind := "UDP and TCP"
	if c.tcpOnly {
		lbKind = "TCP only"
	}

	ov := overlay(t, e.root, filepath.Join(e.dir, "overlay"), e.tag, e.n.UnifiedRoot)
	want := redirect.MechanismOrdering
	if c.unordered {
		ov = unorderedOverlay(t, filepath.Join(e.dir, "overlay-unordered"), ov)
		want = redirect.MechanismBackendCapture
	}
	start := time.Now()
	if out, err := e.n.Kubectl("apply", "-k", ov); err != nil {
		t.Fatalf("kubectl apply -k: %v\n%s", err, out)
	}
	t.Cleanup(func() { e.uninstallBesideLB(t, ov) })
	p := e.waitSettled(t, 2*time.Minute)
	url := fmt.Sprintf("http://%s:9153/metrics", nodetest.NodeIP)
	var body string
	if !testenv.WaitFor(time.Minute, func() bool {
		body, _ = e.n.HTTPGet(url)
		return hasMechanism(body, "connect4", want) && hasMechanism(body, "sendmsg4", want)
	}) {
		t.Fatalf("connect4 and sendmsg4 never captured by %s; the agent's metrics:\n%s\nits log:\n%s",
			want, grepLines(body, "meshdns_datapath_capture_mechanism"), logSummary(e.agentLog(t, p.Metadata.Name), 30))
	}
	ready := time.Since(start)
	status, err := e.n.Kubectl("exec", "-n", agentNS, p.Metadata.Name, "--", "meshdns-ebpf", "status")
	if err != nil {
		t.Errorf("meshdns-ebpf status: %v\n%s", err, status)
	}
	t.Logf("meshdns-ebpf status:\n%s", status)

	translated, restored := lb.Translated(), lb.Restored()
	ld := startLoad(t, e.n, loadRate, e.loadTargets())
	loadStart := time.Now()
	tcp := e.digTCP(t, socketLBTCPLookups)
	time.Sleep(time.Until(loadStart.Add(socketLBWindow)))
	res := ld.stop()
	tl := res.between(0, math.MaxInt64)
	dTrans, dRest := lb.Translated()-translated, lb.Restored()-restored
	body, _ = e.n.HTTPGet(url)
	stalled, noResolver := counterSum(body, "skip_stalled"), counterSum(body, "skip_no_resolver")
	e.rep.add(t, "socket LB (%s) attached first at the node's cgroup root, kube-dns %s -> %s; agent (%s) Ready with connect4/sendmsg4 %s %v after apply; %d/s UDP load: %v; dig +tcp @%s: %s; the LB translated %d and restored %d; the agent's datapath passed %d queries on as its resolver stalled (fail-open), %d with no resolver",
		lbKind, svc, be, p.Metadata.Name, want, ready.Round(time.Millisecond), loadRate, tl, nodetest.ClusterDNS, tcp, dTrans, dRest, stalled, noResolver)
	t.Logf("per client: %s", res.perClient())
	if tl.lost+tl.original+tl.wrongsrc+tl.wrong > 0 {
		t.Errorf("lookups not answered by the agent: %v\n%s", tl, tl.describe(ld.started))
		t.Logf("the agent's datapath counters:\n%s\nits log:\n%s", grepLines(body, "meshdns_datapath_events_total{"),
			logSummary(e.agentLog(t, p.Metadata.Name), 40))
	}
	if tcp.agent != tcp.asked {
		t.Errorf("dig +tcp: %s, want all %d answered by the agent", tcp, tcp.asked)
	}
	// With ours in front the LB never sees the ClusterIP; with backend
	// capture it translates (UDP and TCP, or TCP only) and ours capture the
	// backend after it.
	if !c.unordered && dTrans != 0 {
		t.Errorf("the LB translated %d destinations while ours should run first", dTrans)
	}
	if c.unordered && dTrans == 0 {
		t.Errorf("the LB translated nothing: the configuration did not put it in front of ours")
	}
}

// uninstallBesideLB runs the documented uninstall and checks that it left the
// LB's eight programs, and nothing of the agent's, on the node's cgroup root.
func (e *env) uninstallBesideLB(t *testing.T, ov string) {
	if out, err := e.n.Kubectl("delete", "-k", ov, "--timeout=180s"); err != nil {
		t.Errorf("kubectl delete -k: %v\n%s", err, out)
		return
	}
	if !testenv.WaitFor(2*time.Minute, func() bool { return len(e.agentPods(t)) == 0 }) {
		t.Errorf("agent pods left after kubectl delete -k")
		return
	}
	out, err := e.n.Run("bpftool", "cgroup", "tree", e.n.UnifiedRoot)
	if err != nil {
		t.Errorf("bpftool cgroup tree: %v", err)
		return
	}
	if k := countMatching(out, progLine); k != 8 {
		t.Errorf("after the uninstall %d programs are attached under the node's cgroup root, want the LB's 8:\n%s", k, out)
	}
}

// unorderedOverlay writes a kustomization over base that sets
// redirect.UnorderedEnv=1 in the agent's environment: its programs go on in
// attach order, as on a kernel without ordered cgroup programs.
func unorderedOverlay(t *testing.T, dir, base string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(dir, base)
	if err != nil {
		t.Fatal(err)
	}
	k := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: meshdns-ebpf
        namespace: meshdns-system
      spec:
        template:
          spec:
            containers:
              - name: agent
                env:
                  - name: %s
                    value: "1"
`, rel, redirect.UnorderedEnv)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func hasMechanism(metrics, hook, mechanism string) bool {
	return strings.Contains(metrics, fmt.Sprintf("meshdns_datapath_capture_mechanism{hook=%q,mechanism=%q} 1\n", hook, mechanism))
}

// counterSum sums meshdns_datapath_events_total over the hooks for counter.
func counterSum(metrics, counter string) int {
	sum := 0
	for _, l := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(l, "meshdns_datapath_events_total{") && strings.Contains(l, fmt.Sprintf("counter=%q", counter)) {
			f := strings.Fields(l)
			if v, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
				sum += int(v)
			}
		}
	}
	return sum
}

func grepLines(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// tcpTally is how the dig +tcp lookups were answered.
type tcpTally struct {
	asked, agent, original, other int
}

func (tt tcpTally) String() string {
	return fmt.Sprintf("%d lookups, %d answered by the agent, %d by the original nameserver, %d other lines (errors)",
		tt.asked, tt.agent, tt.original, tt.other)
}

// digTCP asks the ClusterIP n names over TCP from the glibc pod with one dig
// (its queries one after another, one try of 2 s each) and sorts the answers.
func (e *env) digTCP(t *testing.T, n int) tcpTally {
	t.Helper()
	targets := map[string]string{
		"web.team-a.svc.cluster.local.": e.webIP,
		"db.team-b.svc.cluster.local.":  e.dbIP,
		serviceEntryHost + ".":          serviceEntryIP,
		"www." + externalZone + ".":     externalIP,
	}
	names := []string{"web.team-a.svc.cluster.local.", "db.team-b.svc.cluster.local.", serviceEntryHost + ".", "www." + externalZone + "."}
	args := []string{"exec", "-n", "team-a", "glibc", "--", "dig", "+tcp", "+short", "+tries=1", "+time=2", "@" + nodetest.ClusterDNS}
	asked := map[string]int{} // per answer the agent gives
	for i := 0; i < n; i++ {
		args = append(args, names[i%len(names)])
		asked[targets[names[i%len(names)]]]++
	}
	out, err := e.n.Kubectl(args...)
	if err != nil {
		t.Logf("dig +tcp: %v", err)
	}
	tt := tcpTally{asked: n}
	got := map[string]int{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		l = strings.TrimSpace(l)
		switch {
		case l == "":
		case l == nodetest.Marker:
			tt.original++
		case asked[l] > 0:
			got[l]++
		default:
			tt.other++
		}
	}
	// Each name has its own address: an answer is the agent's when it is
	// the address of a name asked, as many times as that name was asked.
	for ip, k := range got {
		tt.agent += min(k, asked[ip])
		tt.other += max(0, k-asked[ip])
	}
	if tt.agent != n {
		t.Logf("dig +tcp printed:\n%s", firstLines(out, 20))
	}
	return tt
}
