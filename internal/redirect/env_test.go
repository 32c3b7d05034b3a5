package redirect

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/link"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The test network, inside a "node" network namespace: original nameservers and
// the resolver's addresses on lo.
var (
	ns1      = netip.MustParseAddr("169.254.53.1")  // captured, slot 0
	ns2      = netip.MustParseAddr("169.254.53.2")  // captured, slot 1
	ns6      = netip.MustParseAddr("fd53::1")       // captured, slot 2
	nsOther  = netip.MustParseAddr("169.254.53.99") // not captured (capture-all: slot 3)
	target4  = netip.MustParseAddr("169.254.20.53")
	target6  = netip.MustParseAddr("fd53::53")
	extAddr  = netip.MustParseAddr("192.0.2.1")
	testMark = uint32(0x3f53)
)

const (
	testBasePort = 5300
	testSlots    = 4 // ns1, ns2, ns6, capture-all
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
	dir, err := os.MkdirTemp("", "meshdns-redirect-client-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	clientBin, err = copyExecutable(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func copyExecutable(dir string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	src, err := os.Open(self)
	if err != nil {
		return "", err
	}
	defer src.Close()
	dst := filepath.Join(dir, "client")
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		return "", err
	}
	if _, err := io.Copy(out, src); err != nil {
		out.Close()
		return "", err
	}
	if err := out.Close(); err != nil {
		return "", err
	}
	return dst, os.Chmod(dir, 0o755)
}

// testNet is one test's cgroup, node namespace, bpffs, original nameservers and
// fake resolver.
type testNet struct {
	cg    *testenv.Cgroup
	node  *testenv.Netns
	bpffs string
	orig  map[netip.Addr]*testenv.FakeDNS
}

func newTestNet(t *testing.T) *testNet {
	t.Helper()
	testenv.RequirePrivileged(t, "ip", "setpriv")
	n := &testNet{orig: map[netip.Addr]*testenv.FakeDNS{}}
	n.cg = testenv.NewCgroup(t)
	n.node = testenv.NewNetns(t, "mdnode")
	for _, a := range []string{ns1.String() + "/32", ns2.String() + "/32", nsOther.String() + "/32", target4.String() + "/32"} {
		n.node.IP(t, "addr", "add", a, "dev", "lo")
	}
	for _, a := range []string{ns6.String() + "/128", target6.String() + "/128"} {
		n.node.IP(t, "-6", "addr", "add", a, "dev", "lo", "nodad")
	}
	for _, a := range []netip.Addr{ns1, ns2, nsOther, ns6} {
		n.orig[a] = testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(a, 53).String(),
			map[string][]netip.Addr{"ext.test": {extAddr}})
	}
	for slot := 0; slot < testSlots; slot++ {
		testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(target4, uint16(testBasePort+slot)).String(),
			map[string][]netip.Addr{"mesh.test": {netip.MustParseAddr(resolverAnswer(4, slot))}})
		testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(target6, uint16(testBasePort+slot)).String(),
			map[string][]netip.Addr{"mesh.test": {netip.MustParseAddr(resolverAnswer(6, slot))}})
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

// install installs cfg, sets it ready and keeps its heartbeat running until the
// test ends, when it is closed (detached, unpinned).
func (n *testNet) install(t *testing.T, cfg Config) *Datapath {
	t.Helper()
	d, err := Install(cfg)
	if err != nil {
		t.Fatalf("Install: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() {
		cancel()
		<-done
		if err := d.Close(false); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	if err := d.SetReady(true); err != nil {
		t.Fatalf("SetReady: %v", err)
	}
	go func() {
		defer close(done)
		d.Run(ctx)
	}()
	return d
}

type proc struct {
	uid  int
	mark uint32
}

// clientCmd builds the client command in the test cgroup and node namespace.
func (n *testNet) clientCmd(ctx context.Context, p proc, args ...string) *exec.Cmd {
	if p.mark != 0 {
		args = append(args, fmt.Sprintf("-mark=%d", p.mark))
	}
	cmd := testenv.Command(ctx, testenv.Proc{Netns: n.node, Cgroup: n.cg, UID: p.uid, GID: p.uid}, clientBin, args...)
	// No async preemption signals: a blocking connect interrupted by one would
	// go on in the background and fail the query spuriously.
	cmd.Env = append(os.Environ(), clientEnv+"=1", "GODEBUG=asyncpreemptoff=1")
	return cmd
}

// query runs the client to completion and returns its results.
func (n *testNet) query(t *testing.T, p proc, args ...string) []clientResult {
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
	return parseResults(t, out)
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
	ci := -1
	for i, c := range counterNames {
		if c == counter {
			ci = i
		}
	}
	if ci < 0 {
		t.Fatalf("unknown counter %s", counter)
	}
	if hookName == "total" {
		return *s.Total.counter(ci)
	}
	for i := range s.Hooks {
		if s.Hooks[i].Hook == hookName {
			return *s.Hooks[i].counter(ci)
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
