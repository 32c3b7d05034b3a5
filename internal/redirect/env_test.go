package redirect

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The test network, inside a "node" network namespace: original nameservers and
// the resolver's addresses on lo.
var (
	ns1      = netip.MustParseAddr("169.254.53.1")  // captured, slot 0
	ns2      = netip.MustParseAddr("169.254.53.2")  // captured, slot 1
	ns6      = netip.MustParseAddr("fd53::1")       // captured, slot 2
	nsOther  = netip.MustParseAddr("169.254.53.99") // not captured (capture-all: slots 3..6)
	target4  = netip.MustParseAddr("169.254.20.53")
	target6  = netip.MustParseAddr("fd53::53")
	extAddr  = netip.MustParseAddr("192.0.2.1")
	testMark = uint32(0x3f53)
)

// others are more uncaptured nameservers, for capture-all tests of one socket
// querying several of them.
var others = []netip.Addr{nsOther, netip.MustParseAddr("169.254.53.100"), netip.MustParseAddr("169.254.53.101"),
	netip.MustParseAddr("169.254.53.102"), netip.MustParseAddr("169.254.53.103")}

const (
	testBasePort = 5300
	testSlots    = 3 + maxAllSlots // ns1, ns2, ns6, capture-all slots
	userUID      = 1000
	proxyUID     = 1337
)

// resolverAnswer is what the fake resolver on slot i of family fam (4 or 6)
// answers for mesh.test: a distinct address per slot and family, so a test sees
// which resolver port and address a query reached.
func resolverAnswer(fam, slot int) string {
	return fmt.Sprintf("10.53.%d.%d", fam, slot)
}

// clientBin is a copy of the test binary that any UID can execute.
var clientBin string

func TestMain(m *testing.M) {
	if os.Getenv(clientEnv) == "1" {
		os.Exit(runClient(os.Args[1:]))
	}
	if os.Getenv(agentEnv) != "" {
		os.Exit(runAgent(os.Getenv(agentEnv)))
	}
	if os.Getenv(probeEnv) == "1" {
		if err := probePrograms(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(testenv.RunWithCopy(m, "meshdns-redirect-client-", &clientBin))
}

// testNet is one test's cgroup, node namespace, bpffs, original nameservers and
// fake resolver.
type testNet struct {
	cg        *testenv.Cgroup
	node      *testenv.Netns
	bpffs     string
	orig      map[netip.Addr]*testenv.FakeDNS
	resolvers []*testenv.FakeDNS // on every target and slot port
}

func newTestNet(t *testing.T) *testNet {
	t.Helper()
	testenv.RequirePrivileged(t, "ip", "setpriv")
	n := &testNet{orig: map[netip.Addr]*testenv.FakeDNS{}}
	n.cg = testenv.NewCgroup(t)
	n.node = testenv.NewNetns(t, "mdnode")
	for _, a := range append([]netip.Addr{ns1, ns2, target4}, others...) {
		n.node.IP(t, "addr", "add", a.String()+"/32", "dev", "lo")
	}
	for _, a := range []string{ns6.String() + "/128", target6.String() + "/128"} {
		n.node.IP(t, "-6", "addr", "add", a, "dev", "lo", "nodad")
	}
	for _, a := range append([]netip.Addr{ns1, ns2, ns6}, others...) {
		n.orig[a] = testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(a, 53).String(),
			map[string][]netip.Addr{"ext.test": {extAddr}})
	}
	for slot := 0; slot < testSlots; slot++ {
		n.resolvers = append(n.resolvers,
			testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(target4, uint16(testBasePort+slot)).String(),
				map[string][]netip.Addr{"mesh.test": {netip.MustParseAddr(resolverAnswer(4, slot))}}),
			testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(target6, uint16(testBasePort+slot)).String(),
				map[string][]netip.Addr{"mesh.test": {netip.MustParseAddr(resolverAnswer(6, slot))}}))
	}
	n.bpffs = testenv.NewBPFFS(t)
	return n
}

func (n *testNet) pinDir() string { return filepath.Join(n.bpffs, "meshdns") }

func (n *testNet) config() Config {
	return Config{
		Cgroup:       n.cg.Path,
		PinDir:       n.pinDir(),
		Target4:      netip.AddrPortFrom(target4, testBasePort),
		Target6:      netip.AddrPortFrom(target6, testBasePort),
		Nameservers:  []netip.Addr{ns1, ns2, ns6},
		ProxyUIDs:    []uint32{proxyUID},
		UpstreamMark: testMark,
	}
}

// start starts a datapath for cfg, registers the fake resolvers (those on a
// target and slot port of cfg) as its resolver sockets, counts their reads as
// its progress, and closes it when the test ends (detached, unpinned).
func (n *testNet) start(t *testing.T, cfg Config) *Datapath {
	t.Helper()
	cfg.Detach = true
	d, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	n.startDatapath(t, d)
	t.Cleanup(func() {
		n.progressTo(nil)
		if err := d.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	n.serve(t, d, cfg)
	return d
}

// startDatapath starts d in the node namespace, as an agent there would (its
// watchdog probes the resolver from there).
func (n *testNet) startDatapath(t *testing.T, d *Datapath) {
	t.Helper()
	if err := n.node.Do(func() error { return d.Start(t.Context()) }); err != nil {
		t.Fatalf("Start: %v", err)
	}
}

// serve registers the fake resolvers that listen on cfg's targets and slot
// ports with d, and makes their reads d's progress.
func (n *testNet) serve(t *testing.T, d *Datapath, cfg Config) {
	t.Helper()
	var socks []Socket
	ports := map[uint16]bool{}
	for _, p := range SlotPorts(cfg) {
		ports[p] = true
	}
	for _, r := range n.resolvers {
		ap := netip.MustParseAddrPort(r.Addr)
		if !ports[ap.Port()] || (ap.Addr() != cfg.Target4.Addr() && ap.Addr() != cfg.Target6.Addr()) {
			continue
		}
		udp, tcp := r.Conns()
		socks = append(socks, Socket{Addr: ap, Conn: udp}, Socket{Addr: ap, TCP: true, Conn: tcp})
	}
	if err := d.Serve(socks); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	n.progressTo(d)
}

// progressTo makes every fake resolver's reads count as d's progress (nil: none).
func (n *testNet) progressTo(d *Datapath) {
	fn := func(int) {}
	if d != nil {
		fn = d.Dequeued
	}
	for _, r := range n.resolvers {
		r.OnRead(fn)
	}
}

type proc struct {
	uid  int
	mark uint32
	cg   *testenv.Cgroup // nil: the test cgroup
}

// clientCmd builds the client command in the test cgroup and node namespace.
func (n *testNet) clientCmd(ctx context.Context, p proc, args ...string) *exec.Cmd {
	if p.mark != 0 {
		args = append(args, fmt.Sprintf("-mark=%d", p.mark))
	}
	cg := p.cg
	if cg == nil {
		cg = n.cg
	}
	cmd := testenv.Command(ctx, testenv.Proc{Netns: n.node, Cgroup: cg, UID: p.uid, GID: p.uid}, clientBin, args...)
	// No async preemption signals: a blocking connect interrupted by one would
	// go on in the background and fail the query spuriously.
	cmd.Env = append(os.Environ(), clientEnv+"=1", "GODEBUG=asyncpreemptoff=1")
	return cmd
}

// query runs the client to completion and returns its results.
func (n *testNet) query(t *testing.T, p proc, args ...string) []clientResult {
	t.Helper()
	rs, _ := n.queryPID(t, p, args...)
	return rs
}

// queryPID is query that also returns the client's process id.
func (n *testNet) queryPID(t *testing.T, p proc, args ...string) ([]clientResult, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := n.clientCmd(ctx, p, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("client %v: %v\nstdout: %s\nstderr: %s", args, err, out, stderr.String())
	}
	return parseResults(t, out), cmd.Process.Pid
}

// resolver is the fake resolver of family fam (4 or 6) on slot.
func (n *testNet) resolver(fam, slot int) *testenv.FakeDNS {
	i := 2 * slot
	if fam == 6 {
		i++
	}
	return n.resolvers[i]
}

func parseResults(t *testing.T, out []byte) []clientResult {
	t.Helper()
	var rs []clientResult
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var r clientResult
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("client output %q: %v", line, err)
		}
		rs = append(rs, r)
	}
	return rs
}

// wantCaptured checks that r was answered by the resolver's slot of family fam
// and that the kernel reported src as reply source (and peer, when given).
func wantCaptured(t *testing.T, r clientResult, fam, slot int, src, peer string) {
	t.Helper()
	if r.Err != "" {
		t.Errorf("query to %s failed: %s", r.Dst, r.Err)
		return
	}
	if r.Rcode != "NOERROR" || len(r.A) != 1 || r.A[0] != resolverAnswer(fam, slot) {
		t.Errorf("query to %s: got %s %v, want NOERROR [%s] from the resolver (v%d slot %d)", r.Dst, r.Rcode, r.A, resolverAnswer(fam, slot), fam, slot)
	}
	if src != "" && r.Src != src {
		t.Errorf("query to %s: reply source %q, want %q", r.Dst, r.Src, src)
	}
	if peer != "" && r.Peer != peer {
		t.Errorf("query to %s: peer %q, want %q", r.Dst, r.Peer, peer)
	}
}

// wantOriginal checks that r was answered by the original nameserver (NXDOMAIN
// for mesh.test).
func wantOriginal(t *testing.T, r clientResult) {
	t.Helper()
	if r.Err != "" {
		t.Errorf("query to %s failed: %s", r.Dst, r.Err)
		return
	}
	if r.Rcode != "NXDOMAIN" || len(r.A) != 0 {
		t.Errorf("query to %s: got %s %v, want NXDOMAIN from the original nameserver", r.Dst, r.Rcode, r.A)
	}
}

// hookCounter returns one counter of one hook from the pinned maps.
func hookCounter(t *testing.T, pinDir, hookName, counter string) uint64 {
	t.Helper()
	s, err := ReadStats(pinDir)
	if err != nil {
		t.Fatalf("ReadStats: %v", err)
	}
	return counterOf(t, s, hookName, counter)
}

func counterOf(t *testing.T, s *Stats, hookName, counter string) uint64 {
	t.Helper()
	if !containsString(CounterNames(), counter) {
		t.Fatalf("unknown counter %s", counter)
	}
	if hookName == "total" {
		return s.Total.Get(counter)
	}
	for i := range s.Hooks {
		if s.Hooks[i].Hook == hookName {
			return s.Hooks[i].Get(counter)
		}
	}
	t.Fatalf("unknown hook %s", hookName)
	return 0
}

// attachedPrograms counts the programs attached to the cgroup, over all our hooks.
func attachedPrograms(t *testing.T, cg *testenv.Cgroup) int {
	t.Helper()
	total := 0
	for _, h := range hooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: cg.FD(), Attach: h.attach})
		if err != nil {
			t.Fatalf("query programs of %s on %s: %v", h.section, cg.Path, err)
		}
		total += len(res.Programs)
	}
	return total
}

// pinsUnder lists every file and directory below the bpffs mount dir, except
// the kernel's own iterators (maps.debug, progs.debug) at its top.
func pinsUnder(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if p != dir && !(filepath.Dir(p) == dir && strings.HasSuffix(p, ".debug")) {
			out = append(out, p)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", dir, err)
	}
	return out
}

func hp(a netip.Addr, port uint16) string { return netip.AddrPortFrom(a, port).String() }

func mapped(a netip.Addr) netip.Addr { return netip.AddrFrom16(a.As16()) }

// passProgram loads a program of type typ for attach that lets everything
// through (a foreign program, or one an older version left).
func passProgram(t *testing.T, typ ebpf.ProgramType, attach ebpf.AttachType) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: typ, AttachType: attach, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}
