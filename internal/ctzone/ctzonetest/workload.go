//go:build linux

package ctzonetest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Defaults of the topology.
var (
	PodAddr     = netip.MustParseAddr("169.254.99.2") // the pod's source address
	NodeAddr    = netip.MustParseAddr("169.254.99.1") // the node end of the veth
	Nameserver  = netip.MustParseAddr("169.254.53.1") // fake upstream, the pod's resolv.conf nameserver
	MeshAnswer  = netip.MustParseAddr("240.240.0.1")  // what the proxy answers for mesh names
	ExtAnswer   = netip.MustParseAddr("192.0.2.10")   // what the upstream answers for ExternalName
	ProxyListen = netip.MustParseAddrPort("127.0.0.1:15053")
)

// Names.
const (
	MeshSuffix   = "mesh.test."
	ExternalName = "www.example.test."
	ProxyUID     = 1337 // Istio's proxy user
	AppUID       = 1000
)

// Topology is the pod namespace (application and proxy), the node namespace
// (fake upstream) and the cgroup both processes run in.
type Topology struct {
	Pod, Node  *testenv.Netns
	Cgroup     *testenv.Cgroup
	Upstream   *testenv.FakeDNS // at Nameserver:53 in Node
	Nameserver netip.Addr
	PortLo     int // the pod's net.ipv4.ip_local_port_range
	PortHi     int
	binary     string
}

// NewTopology builds the namespaces, the veth pair, the fake upstream and the
// narrow port range [portLo, portHi]. Everything is removed at test cleanup.
func NewTopology(t *testing.T, portLo, portHi int) *Topology {
	t.Helper()
	testenv.RequirePrivileged(t, "ip", "setpriv", "sysctl")
	tp := &Topology{
		Cgroup:     testenv.NewCgroup(t),
		Node:       testenv.NewNetns(t, "mdct-node"),
		Pod:        testenv.NewNetns(t, "mdct-pod"),
		Nameserver: Nameserver,
		PortLo:     portLo,
		PortHi:     portHi,
	}
	testenv.Veth(t, tp.Node, "veth-pod", NodeAddr.String()+"/30", tp.Pod, "eth0", PodAddr.String()+"/30")
	tp.Node.IP(t, "addr", "add", Nameserver.String()+"/32", "dev", "lo")
	tp.Pod.IP(t, "route", "add", "default", "via", NodeAddr.String())
	tp.Pod.SetResolvConf(t, "nameserver "+Nameserver.String()+"\n")
	tp.Pod.Exec(t, "sysctl", "-q", "-w", fmt.Sprintf("net.ipv4.ip_local_port_range=%d %d", portLo, portHi))
	tp.Upstream = testenv.StartFakeDNS(t, tp.Node, netip.AddrPortFrom(Nameserver, 53).String(), map[string][]netip.Addr{
		ExternalName: {ExtAnswer},
	})
	tp.binary = helperBinary(t)
	return tp
}

// helperBinary copies the running test binary to a directory every user can
// read, so the helpers can run as the proxy and application users.
func helperBinary(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatalf("find test binary: %v", err)
	}
	dir, err := os.MkdirTemp("", "meshdns-ctzonetest-")
	if err != nil {
		t.Fatalf("helper dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatalf("helper dir: %v", err)
	}
	dst := filepath.Join(dir, "helper")
	in, err := os.Open(self)
	if err != nil {
		t.Fatalf("copy test binary: %v", err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatalf("copy test binary: %v", err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatalf("copy test binary: %v", err)
	}
	if err := out.Close(); err != nil {
		t.Fatalf("copy test binary: %v", err)
	}
	return dst
}

func (tp *Topology) helper(ctx context.Context, which string, uid, gid int, args ...string) *exec.Cmd {
	cmd := testenv.Command(ctx, testenv.Proc{Netns: tp.Pod, Cgroup: tp.Cgroup, UID: uid, GID: gid}, tp.binary, args...)
	cmd.Env = append(os.Environ(), HelperEnv+"="+which)
	return cmd
}

// ProxyOptions says how the proxy runs.
type ProxyOptions struct {
	UID, GID int    // 0: root
	Mark     uint32 // SO_MARK of its upstream sockets (needs root); 0: none
	Listen   netip.AddrPort
	// Register returns the pin directory of an eBPF datapath the proxy registers
	// its sockets with (as a resolver), once the scenario's capture is set up;
	// nil or "": none.
	Register func() string
}

// StartProxy starts the proxy in the pod namespace and waits until it listens.
// It is stopped at test cleanup.
func (tp *Topology) StartProxy(t *testing.T, o ProxyOptions) {
	t.Helper()
	if !o.Listen.IsValid() {
		o.Listen = ProxyListen
	}
	register := ""
	if o.Register != nil {
		register = o.Register()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cmd := tp.helper(ctx, "proxy", o.UID, o.GID, "-listen", o.Listen.String(),
		"-upstream", netip.AddrPortFrom(tp.Nameserver, 53).String(), "-mark", strconv.FormatUint(uint64(o.Mark), 10),
		"-suffix", MeshSuffix, "-answer", MeshAnswer.String(), "-register", register)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatalf("proxy stdout: %v", err)
	}
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start proxy: %v", err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		cancel()
		<-done
	})
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		ok := sc.Scan() && sc.Text() == "ready"
		ready <- ok
		_, _ = io.Copy(io.Discard, stdout)
		_ = cmd.Wait()
		close(done)
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("proxy did not start: %s", stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("proxy did not start within 15s: %s", stderr.String())
	}
}

// AppOptions says what the application sends.
type AppOptions struct {
	UID, GID int
	Mesh     int // mesh queries
	External int // external queries after each mesh query (default 1)
	Timeout  time.Duration
}

// Result is one workload run.
type Result struct {
	AppResult
	UpstreamMesh     int      // mesh queries the fake upstream saw
	ProxyPorts       []uint16 // source ports of the proxy's upstream queries
	SharedPorts      int      // ports used both by the app and for the proxy's upstream queries
	UpstreamExternal int
}

// MisroutedShare is Misrouted / Mesh.
func (r Result) MisroutedShare() float64 {
	if r.Mesh == 0 {
		return 0
	}
	return float64(r.Misrouted) / float64(r.Mesh)
}

func (r Result) String() string {
	return fmt.Sprintf("mesh %d: ok %d, misrouted %d (%.1f%%), lost %d, other %d; external %d: ok %d, failed %d; upstream saw %d mesh and %d external queries; app used %d ports, %d of them also used by the proxy upstream; dial failures %d",
		r.Mesh, r.MeshOK, r.Misrouted, 100*r.MisroutedShare(), r.MeshLost, r.MeshOther, r.External, r.ExternalOK, r.ExternalFail,
		r.UpstreamMesh, r.UpstreamExternal, len(r.Ports), r.SharedPorts, r.DialFailures)
}

// RunApp runs the application to completion and collects what it and the fake
// upstream saw.
func (tp *Topology) RunApp(t *testing.T, o AppOptions) Result {
	t.Helper()
	if o.External == 0 {
		o.External = 1
	}
	if o.Timeout == 0 {
		o.Timeout = time.Second
	}
	if o.UID == 0 && o.GID == 0 {
		o.UID, o.GID = AppUID, AppUID
	}
	tp.Upstream.Reset()
	// Generous: each query is sub-millisecond; lost ones cost Timeout.
	limit := 10*time.Minute + time.Duration(o.Mesh*(1+o.External))*time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := tp.helper(ctx, "app", o.UID, o.GID, "-ns", netip.AddrPortFrom(tp.Nameserver, 53).String(),
		"-mesh", strconv.Itoa(o.Mesh), "-external", strconv.Itoa(o.External), "-suffix", MeshSuffix,
		"-mesh-answer", MeshAnswer.String(), "-external-name", ExternalName, "-external-answer", ExtAnswer.String(),
		"-timeout", o.Timeout.String())
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("app: %v: %s", err, stderr.String())
	}
	var res Result
	if err := json.Unmarshal(out, &res.AppResult); err != nil {
		t.Fatalf("app output %q: %v", out, err)
	}
	seen := map[uint16]bool{}
	for _, q := range tp.Upstream.Queries() {
		if q.Proto != "udp" || q.Source.Addr() != PodAddr {
			continue
		}
		if strings.HasSuffix(q.Name, "."+MeshSuffix) {
			res.UpstreamMesh++
		} else if q.Name == ExternalName {
			res.UpstreamExternal++
		}
		seen[q.Source.Port()] = true
	}
	for p := range seen {
		res.ProxyPorts = append(res.ProxyPorts, p)
		if res.Ports[p] > 0 {
			res.SharedPorts++
		}
	}
	return res
}

// Scenario is one complete run: topology, capture, proxy, application.
type Scenario struct {
	PortLo, PortHi int // default 40000-40007
	// Capture installs the capture under test (inside tp.Pod, or attached to
	// tp.Cgroup); it must undo it at test cleanup.
	Capture func(t *testing.T, tp *Topology)
	Proxy   ProxyOptions
	App     AppOptions
	// After, if set, runs after the application, before cleanup (e.g. to read
	// conntrack in tp.Pod).
	After func(t *testing.T, tp *Topology, r Result)
}

// Run runs the scenario and returns its result.
func Run(t *testing.T, s Scenario) Result {
	t.Helper()
	if s.PortLo == 0 {
		s.PortLo, s.PortHi = 40000, 40007
	}
	tp := NewTopology(t, s.PortLo, s.PortHi)
	if s.Capture != nil {
		s.Capture(t, tp)
	}
	tp.StartProxy(t, s.Proxy)
	start := time.Now()
	r := tp.RunApp(t, s.App)
	t.Logf("workload (%s): %s", time.Since(start).Round(time.Millisecond), r)
	if s.After != nil {
		s.After(t, tp, r)
	}
	return r
}
