// Package e2e runs the meshdns-ebpf binary as a node agent on the real kernel and
// proves, with real resolvers as clients (glibc, Go, dig, musl), that captured DNS
// reaches our resolver and that everything is undone on stop. Every test builds its
// own node: a cgroup, network namespaces joined by veth pairs, a private bpffs, fake
// "original" nameservers that answer NXDOMAIN for mesh names, and the agent inside
// the cgroup (so its own upstream queries are subject to the programs too).
package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone/ctzonetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The binaries of the package, built once per test binary (agenttest).
var bins struct {
	agent, goresolve, dnsblast, musl string
	// Load generators (testdata/dnsload, testdata/goload): glibc, musl, Go.
	loadGlibc, loadMusl, loadGo string
	// Resolve -> connect clients (testdata/egressload, testdata/goegress), built by
	// the egress tests.
	egressGlibc, egressMusl, egressGo string
}

func buildBinaries(t *testing.T) {
	t.Helper()
	bins.agent = agenttest.Agent(t)
	bins.goresolve = agenttest.GoBinary(t, "./test/e2e/testdata/goresolve")
	bins.dnsblast = agenttest.GoBinary(t, "./test/e2e/testdata/dnsblast")
	bins.loadGo = agenttest.GoBinary(t, "./test/e2e/testdata/goload")
	bins.musl = agenttest.Program(t, "muslresolve", "musl-gcc", "-static", "-O2", "-o", agenttest.Out, "test/e2e/testdata/muslresolve.c")
	bins.loadMusl = agenttest.Program(t, "dnsload-musl", "musl-gcc", "-static", "-O2", "-pthread", "-o", agenttest.Out, "test/e2e/testdata/dnsload/dnsload.c")
	bins.loadGlibc = agenttest.Program(t, "dnsload-glibc", "gcc", "-O2", "-pthread", "-o", agenttest.Out, "test/e2e/testdata/dnsload/dnsload.c")
}

func TestMain(m *testing.M) {
	ctzonetest.MaybeRunHelper() // the collision workload re-executes this binary
	code := m.Run()
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// Addresses of the test node. All link-local or ULA, inside namespaces the test made.
const (
	origNS    = "169.254.53.1"  // the "original" nameserver the clients' resolv.conf names
	origNS6   = "fd53::1"       // an IPv6 original nameserver
	otherNS   = "169.254.53.99" // a nameserver that is not captured by default
	listen4   = "169.254.20.53" // the resolver's node-local address
	listen6   = "fd53::53"
	adminAddr = "127.0.0.1:19153"

	meshName  = "productpage.default.svc.cluster.local"
	meshIP    = "240.240.0.10"
	meshName6 = "ratings.default.svc.cluster.local"
	meshIP6   = "2001:2::14"
	extName   = "ext.test"
	extIP     = "169.254.77.7"

	// Forwarded names no cache holds (load tests ask q<n>.<zone>), answered by the
	// upstream (the original nameserver) at once, or after slowDelay.
	fwdZone   = "fwd.test"
	fwdIP     = "169.254.77.9"
	slowZone  = "slow.test"
	slowIP    = "169.254.77.8"
	slowDelay = 300 * time.Millisecond
)

const namesYAML = `table:
  productpage.default.svc.cluster.local:
    ips: ["240.240.0.10"]
    registry: Kubernetes
    shortname: productpage
    namespace: default
  ratings.default.svc.cluster.local:
    ips: ["240.240.0.14", "2001:2::14"]
    registry: Kubernetes
    shortname: ratings
    namespace: default
`

// node is one test's simulated Kubernetes node.
type node struct {
	t        *testing.T
	cg       *testenv.Cgroup
	ns       *testenv.Netns // the node's network namespace (the agent's)
	pod      *testenv.Netns // a pod joined by veth, resolv.conf → origNS
	pod6     *testenv.Netns // a pod whose resolv.conf names only origNS6
	podMap   *testenv.Netns // a pod whose resolv.conf names an unreachable v6 server, then origNS (musl: v4-mapped)
	bpffs    string
	stateDir string
	names    string
	orig     *testenv.FakeDNS
	orig6    *testenv.FakeDNS
	other    *testenv.FakeDNS

	agent   *agenttest.Process // the current agent
	agentCg *testenv.Cgroup    // where agents run (nil: cg); a child of cg, so their upstream queries meet the programs too
	stderr  *agenttest.Log     // every agent's output
}

func newNode(t *testing.T) *node {
	t.Helper()
	testenv.RequirePrivileged(t, "ip", "nsenter", "setpriv", "dig", "getent", "musl-gcc", "bpftool")
	buildBinaries(t)
	n := &node{t: t, cg: testenv.NewCgroup(t), bpffs: filepath.Join(testenv.NewBPFFS(t), "meshdns"), stateDir: t.TempDir()}
	n.ns = testenv.NewNetns(t, "mde-node")
	n.ns.IP(t, "addr", "add", origNS+"/32", "dev", "lo")
	n.ns.IP(t, "addr", "add", otherNS+"/32", "dev", "lo")
	n.ns.IP(t, "-6", "addr", "add", origNS6+"/128", "dev", "lo", "nodad")
	n.ns.SetResolvConf(t, "nameserver "+origNS+"\noptions timeout:1 attempts:1\n")

	for i, spec := range []struct {
		p    **testenv.Netns
		conf string
	}{
		{&n.pod, "nameserver " + origNS + "\n"},
		{&n.pod6, "nameserver " + origNS6 + "\n"},
		{&n.podMap, "nameserver fd53::99\nnameserver " + origNS + "\n"},
	} {
		p := testenv.NewNetns(t, "mde-pod")
		*spec.p = p
		nodeIf := fmt.Sprintf("vpod%d", i)
		testenv.Veth(t, n.ns, nodeIf, fmt.Sprintf("169.254.10%d.1/30", i), p, "eth0", fmt.Sprintf("169.254.10%d.2/30", i))
		n.ns.IP(t, "-6", "addr", "add", fmt.Sprintf("fd00:10%d::1/64", i), "dev", nodeIf, "nodad")
		p.IP(t, "-6", "addr", "add", fmt.Sprintf("fd00:10%d::2/64", i), "dev", "eth0", "nodad")
		p.IP(t, "route", "add", "default", "via", fmt.Sprintf("169.254.10%d.1", i))
		p.IP(t, "-6", "route", "add", "default", "via", fmt.Sprintf("fd00:10%d::1", i))
		p.SetResolvConf(t, spec.conf+"options timeout:1 attempts:2\n")
	}

	records := map[string][]netip.Addr{
		extName:         {netip.MustParseAddr(extIP)},
		"*." + fwdZone:  {netip.MustParseAddr(fwdIP)},
		"*." + slowZone: {netip.MustParseAddr(slowIP)},
	}
	n.orig = testenv.StartFakeDNS(t, n.ns, origNS+":53", records)
	n.orig.SetNameDelay("*."+slowZone, slowDelay)
	n.orig6 = testenv.StartFakeDNS(t, n.ns, "["+origNS6+"]:53", records)
	n.other = testenv.StartFakeDNS(t, n.ns, otherNS+":53", records)

	n.names = filepath.Join(t.TempDir(), "names.yaml")
	if err := os.WriteFile(n.names, []byte(namesYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.stop)
	return n
}

// agentArgs are the flags every test agent gets; extra ones are appended.
func (n *node) agentArgs(mode string, extra ...string) []string {
	args := []string{"run", "--mode", mode,
		"--cgroup", n.cg.Path,
		"--listen", listen4 + ":53,[" + listen6 + "]:53",
		"--nameservers", origNS + "," + origNS6,
		"--upstream", origNS,
		"--names", n.names,
		"--admin", adminAddr,
		"--bpffs", n.bpffs,
		"--state-dir", n.stateDir,
		"--proxy-uid", "1337",
		"--log-level", "debug",
	}
	return append(args, extra...)
}

// start runs the agent in the node namespace, inside the test cgroup, with only
// the capabilities of its mode, and waits until a captured client resolves a
// mesh name.
func (n *node) start(mode string, extra ...string) {
	n.t.Helper()
	n.startNoWait(mode, extra...)
	n.waitAnswering(n.agent)
	// Probes sent before the agent was ready went, fail-open, to the original
	// nameservers: forget them, so tests count only their own queries.
	n.orig.Reset()
	n.orig6.Reset()
	n.other.Reset()
}

// waitAnswering waits until a captured client resolves a mesh name (through p
// or whichever agent serves), and fails if p exits meanwhile.
func (n *node) waitAnswering(p *agenttest.Process) {
	n.t.Helper()
	exited := false
	if !testenv.WaitFor(15*time.Second, func() bool {
		if p.Exited() {
			exited = true
			return true
		}
		out, _ := n.client(n.ns, 1000, "dig", "+short", "+time=1", "+tries=1", meshName)
		return strings.TrimSpace(out) == meshIP
	}) {
		n.t.Fatalf("agent never answered %s through capture; agent log:\n%s", meshName, n.stderr.String())
	}
	if exited {
		_, err := p.Wait(0)
		n.t.Fatalf("agent exited during start (%v); log:\n%s", err, n.stderr.String())
	}
}

func (n *node) startNoWait(mode string, extra ...string) {
	n.t.Helper()
	n.agent = n.spawn(mode, extra...)
}

// spawn starts an agent process (it does not replace n.agent).
func (n *node) spawn(mode string, extra ...string) *agenttest.Process {
	n.t.Helper()
	return n.spawnWrapped(mode, nil, extra...)
}

// spawnWrapped starts an agent process run by wrapper (e.g. unshare ... --).
func (n *node) spawnWrapped(mode string, wrapper []string, extra ...string) *agenttest.Process {
	n.t.Helper()
	if n.stderr == nil {
		n.stderr = &agenttest.Log{}
	}
	fmt.Fprintf(n.stderr, "--- agent start: %v %v\n", wrapper, extra)
	// The wrapper runs as root; the agent gets only its mode's capabilities.
	caps := testenv.ModeCaps[mode]
	argv := append([]string{}, wrapper...)
	if len(wrapper) > 0 {
		argv = append(argv, testenv.OnlyCaps(caps)...)
		caps = nil
	}
	argv = append(append(argv, bins.agent), n.agentArgs(mode, extra...)...)
	cg := n.cg
	if n.agentCg != nil {
		cg = n.agentCg
	}
	cmd := testenv.Command(context.Background(), testenv.Proc{Netns: n.ns, Cgroup: cg, NetOnly: true, Caps: caps},
		argv[0], argv[1:]...)
	// The node stops its agents (stop); one a test leaves dies with its cgroup.
	return agenttest.Start(n.t, cmd, agenttest.Options{Log: n.stderr, Unmanaged: true})
}

// waitRedirected waits until the datapath redirected k more queries.
func (n *node) waitRedirected(k uint64) {
	n.t.Helper()
	base := hookCounter(n.t, n, "total", "redirected_udp")
	if !testenv.WaitFor(30*time.Second, func() bool { return hookCounter(n.t, n, "total", "redirected_udp") >= base+k }) {
		n.t.Fatalf("fewer than %d queries redirected in 30 s", k)
	}
}

// upgrade starts a successor beside the running agent and waits until it has
// taken over (its state file names it), then SIGTERMs the old one, as a surge
// rollout or an operator does.
func (n *node) upgrade(mode string, extra ...string) {
	n.t.Helper()
	old := n.agent
	next := n.spawn(mode, extra...)
	if !testenv.WaitFor(20*time.Second, func() bool {
		st, err := n.state()
		return next.Exited() || (err == nil && st.PID == next.Pid())
	}) || next.Exited() {
		n.t.Fatalf("the successor (pid %d) did not take over; log:\n%s", next.Pid(), n.stderr.String())
	}
	n.agent = next
	if err := old.Signal(syscall.SIGTERM); err != nil {
		n.t.Fatalf("SIGTERM the old agent: %v", err)
	}
	if ok, err := old.Wait(10 * time.Second); !ok || err != nil {
		n.t.Fatalf("the old agent (pid %d) did not exit cleanly after the handover (%v); log:\n%s", old.Pid(), err, n.stderr.String())
	}
}

// state reads the agent's state file.
func (n *node) state() (*agentState, error) {
	b, err := os.ReadFile(filepath.Join(n.stateDir, "agent.json"))
	if err != nil {
		return nil, err
	}
	var st agentState
	return &st, json.Unmarshal(b, &st)
}

type agentState struct {
	PID         int `json:"pid"`
	Predecessor int `json:"predecessor"`
}

// signal sends sig to the agent and, for SIGTERM, waits for it to exit.
func (n *node) signal(sig syscall.Signal) error {
	n.t.Helper()
	ok, err := n.agent.SignalAndWait(sig, 10*time.Second)
	if !ok {
		if err != nil {
			return err
		}
		n.t.Fatalf("agent did not exit after %v; log:\n%s", sig, n.stderr.String())
	}
	n.agent = nil
	return err
}

func (n *node) stop() {
	if n.agent != nil {
		n.agent.Stop(agenttest.StopGrace)
		n.agent = nil
	}
	// Whatever a test left (a kill -9), cleanup removes; it is a no-op otherwise.
	_, _ = n.cli("cleanup", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if n.t.Failed() && n.stderr != nil {
		n.t.Logf("agent log:\n%s", n.stderr.String())
	}
}

// client runs a client in netns (ip netns exec: it sees the namespace's resolv.conf),
// inside the test cgroup, as uid.
func (n *node) client(ns *testenv.Netns, uid int, name string, args ...string) (string, error) {
	return n.clientIn(n.cg, ns, uid, 15*time.Second, name, args...)
}

// clientIn runs a client as client does, in cgroup cg, for at most d.
func (n *node) clientIn(cg *testenv.Cgroup, ns *testenv.Netns, uid int, d time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cmd := testenv.Command(ctx, testenv.Proc{Netns: ns, Cgroup: cg, UID: uid, GID: uid}, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.String(), fmt.Errorf("%s %v: %w: %s", name, args, err, stderr.String())
	}
	return stdout.String(), nil
}

// cli runs the meshdns-ebpf CLI in the node's network namespace, where an operator
// would run it (status asks the agent's admin endpoint there; cleanup removes the
// agent's address there).
func (n *node) cli(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := testenv.Command(ctx, testenv.Proc{Netns: n.ns, NetOnly: true}, bins.agent, args...).CombinedOutput()
	return string(out), err
}

// statsJSON reads `stats -o json`.
func (n *node) statsJSON() map[string]any {
	n.t.Helper()
	out, err := n.cli("stats", "--bpffs", n.bpffs, "-o", "json")
	if err != nil {
		n.t.Fatalf("stats -o json: %v", err)
	}
	var v map[string]any
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		n.t.Fatalf("stats -o json: %v\n%s", err, out)
	}
	return v
}

// attached lists the programs attached to the test cgroup, per attach type.
func (n *node) attached() []string {
	n.t.Helper()
	var out []string
	for _, at := range []ebpf.AttachType{
		ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
		ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
		ebpf.AttachCGroupUDP4Recvmsg, ebpf.AttachCGroupUDP6Recvmsg,
		ebpf.AttachCgroupInet4GetPeername, ebpf.AttachCgroupInet6GetPeername,
		ebpf.AttachCgroupInetSockRelease, ebpf.AttachCGroupInetEgress,
	} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(n.cg.FD()), Attach: at})
		if err != nil {
			n.t.Fatalf("query programs on %s: %v", n.cg.Path, err)
		}
		for _, p := range res.Programs {
			out = append(out, fmt.Sprintf("%v:%d", at, p.ID))
		}
	}
	return out
}

// pins lists what is pinned under the test's bpffs directory.
func (n *node) pins() []string {
	var out []string
	_ = filepath.Walk(n.bpffs, func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// assertStopped checks what a stop leaves: the programs attached and pinned
// for the next agent but inert (no resolver socket registered: nothing is
// redirected), and no state file, lock holder or node address.
func (n *node) assertStopped() {
	n.t.Helper()
	if a := n.attached(); len(a) == 0 {
		n.t.Errorf("no program attached to %s after a stop: the next agent cannot adopt them", n.cg.Path)
	}
	out, err := n.cli("status", "--bpffs", n.bpffs, "--state-dir", n.stateDir, "-o", "json")
	if err != nil {
		n.t.Fatalf("status: %v\n%s", err, out)
	}
	var st struct {
		Running  bool `json:"running"`
		Datapath *struct {
			Capturing       bool `json:"capturing"`
			ResolverSockets int  `json:"resolver_sockets"`
		} `json:"datapath"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		n.t.Fatalf("status -o json: %v\n%s", err, out)
	}
	if st.Running || st.Datapath == nil || st.Datapath.Capturing || st.Datapath.ResolverSockets != 0 {
		n.t.Errorf("status after a stop: running=%v datapath=%+v, want not running, attached but not capturing", st.Running, st.Datapath)
	}
	if _, err := os.Stat(filepath.Join(n.stateDir, "agent.json")); err == nil {
		n.t.Errorf("state file left in %s", n.stateDir)
	}
	if out := n.ns.IP(n.t, "addr", "show"); strings.Contains(out, listen4) {
		n.t.Errorf("node address %s left:\n%s", listen4, out)
	}
}

// assertClean checks that nothing of the agent is left: programs, pins, state,
// node address.
func (n *node) assertClean() {
	n.t.Helper()
	if a := n.attached(); len(a) > 0 {
		n.t.Errorf("programs still attached to %s: %v", n.cg.Path, a)
	}
	if p := n.pins(); len(p) > 0 {
		n.t.Errorf("pins left: %v", p)
	}
	if _, err := os.Stat(filepath.Join(n.stateDir, "agent.json")); err == nil {
		n.t.Errorf("state file left in %s", n.stateDir)
	}
	if out := n.ns.IP(n.t, "addr", "show"); strings.Contains(out, listen4) {
		n.t.Errorf("node address %s left:\n%s", listen4, out)
	}
}

// httpGet fetches a URL from inside the node's network namespace (where the
// agent's admin endpoint listens).
func (n *node) httpGet(url string) (int, string) {
	n.t.Helper()
	c := n.ns.HTTPClient(5 * time.Second)
	defer c.CloseIdleConnections()
	resp, err := c.Get(url)
	if err != nil {
		n.t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// logged waits up to 2 s for the agent log to contain s (the agent may still be
// finishing its start when clients already get answers).
func (n *node) logged(s string) bool {
	return testenv.WaitFor(2*time.Second, func() bool { return strings.Contains(n.stderr.String(), s) })
}
