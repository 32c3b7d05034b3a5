package egress

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The test's "internet": addresses from the benchmarking ranges
// (198.18.0.0/15, 2001:2::/48) on lo of a network namespace the test creates,
// with TCP and UDP listeners on ports 8080 and 8081 of every address.
var (
	inet1    = netip.MustParseAddr("198.18.0.1")
	inet2    = netip.MustParseAddr("198.18.0.2")
	inet3    = netip.MustParseAddr("198.18.0.3")
	inetInt  = netip.MustParseAddr("198.19.0.10") // inside the internal prefix below
	inet6    = netip.MustParseAddr("2001:2::1")
	inet6b   = netip.MustParseAddr("2001:2::2")
	internal = netip.MustParsePrefix("198.19.0.0/16")
	target4  = netip.MustParseAddr("169.254.20.53")
	ns1      = netip.MustParseAddr("169.254.53.1")
)

const (
	port      = 8080
	otherPort = 8081
	basePort  = 5300
	userUID   = 1000
	clientEnv = "MESHDNS_EGRESS_TEST_CLIENT"
)

var clientBin string

func TestMain(m *testing.M) {
	if os.Getenv(clientEnv) == "1" {
		os.Exit(runClient(os.Args[1:]))
	}
	os.Exit(testenv.RunWithCopy(m, "meshdns-egress-client-", &clientBin))
}

// runClient is the client's main: each argument is kind/addr:port with kind
// tcp (connect), udpc (connected UDP: connect, send) or udp (unconnected:
// sendto); it prints "kind/addr:port ok" or the errno's name per argument.
// "loop N kind/addr:port" tries N times (for the benchmark) and prints the
// CPU time the loop took ("cpu_ns <ns>"), or the first failure.
func runClient(args []string) int {
	if len(args) == 3 && args[0] == "loop" {
		n, err := strconv.Atoi(args[1])
		if err != nil {
			return 2
		}
		var before, after unix.Rusage
		_ = unix.Getrusage(unix.RUSAGE_SELF, &before)
		for range n {
			if err := attempt(args[2]); err != nil {
				fmt.Printf("%s %v\n", args[2], err)
				return 1
			}
		}
		_ = unix.Getrusage(unix.RUSAGE_SELF, &after)
		cpu := func(r *unix.Rusage) int64 { return r.Utime.Nano() + r.Stime.Nano() }
		fmt.Printf("cpu_ns %d\n", cpu(&after)-cpu(&before))
		return 0
	}
	for _, a := range args {
		res := "ok"
		if err := attempt(a); err != nil {
			res = errName(err)
		}
		fmt.Printf("%s %s\n", a, res)
	}
	return 0
}

func errName(err error) string {
	var errno unix.Errno
	if errors.As(err, &errno) {
		return unix.ErrnoName(errno)
	}
	return err.Error()
}

func attempt(arg string) error {
	kind, dst, ok := strings.Cut(arg, "/")
	ap, err := netip.ParseAddrPort(dst)
	if !ok || err != nil {
		return fmt.Errorf("bad argument %q", arg)
	}
	typ := unix.SOCK_DGRAM
	if kind == "tcp" {
		typ = unix.SOCK_STREAM
	}
	var (
		fam = unix.AF_INET6
		sa  unix.Sockaddr
	)
	if ap.Addr().Is4() {
		fam = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	} else {
		sa = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	}
	fd, err := unix.Socket(fam, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	switch kind {
	case "tcp":
		return unix.Connect(fd, sa)
	case "udpc":
		if err := unix.Connect(fd, sa); err != nil {
			return err
		}
		_, err := unix.Write(fd, []byte("x"))
		return err
	case "udp":
		return unix.Sendto(fd, []byte("x"), 0, sa)
	}
	return fmt.Errorf("bad kind %q", kind)
}

// env is one test's cgroups, network namespace, datapath and Egress.
type env struct {
	cg       *testenv.Cgroup // where the datapath attaches
	net      *testenv.Netns
	bpffs    string
	dp       *redirect.Datapath
	eg       *Egress
	resolver *testenv.FakeDNS // the "agent's" resolver socket (target4:basePort)
	grantCap int
	// resolverGone: the test closed the resolver's sockets.
	resolverGone bool
}

// envOpts vary a test's setup.
type envOpts struct {
	persist bool   // the datapath is left pinned at Close (the test removes the pins)
	grants  int    // the grant cap (0: the default)
	egress  Config // the Egress's config (Datapath is set)
}

func newEnv(t testing.TB, o envOpts) *env {
	t.Helper()
	testenv.RequirePrivileged(t, "ip", "setpriv")
	e := &env{cg: testenv.NewCgroup(t), net: testenv.NewNetns(t, "mdinet"), bpffs: testenv.NewBPFFS(t)}
	for _, a := range []netip.Addr{inet1, inet2, inet3, inetInt, target4, ns1} {
		e.net.IP(t, "addr", "add", a.String()+"/32", "dev", "lo")
	}
	for _, a := range []netip.Addr{inet6, inet6b} {
		e.net.IP(t, "-6", "addr", "add", a.String()+"/128", "dev", "lo", "nodad")
	}
	e.listen(t)
	e.resolver = testenv.StartFakeDNS(t, e.net, netip.AddrPortFrom(target4, basePort).String(), nil)
	e.grantCap = o.grants
	e.startDatapath(t, !o.persist)
	e.serve(t)
	e.startEgress(t, o.egress)
	return e
}

// listen opens TCP (accepting and closing) and UDP (reading) listeners on the
// wildcard addresses of the namespace, both families, both ports.
func (e *env) listen(t testing.TB) {
	t.Helper()
	for _, p := range []int{port, otherPort} {
		for _, nw := range []string{"tcp4", "tcp6"} {
			var l net.Listener
			if err := e.net.Do(func() (err error) {
				l, err = net.Listen(nw, ":"+strconv.Itoa(p))
				return err
			}); err != nil {
				t.Fatalf("listen %s %d: %v", nw, p, err)
			}
			t.Cleanup(func() { l.Close() })
			go func() {
				for {
					c, err := l.Accept()
					if err != nil {
						return
					}
					c.Close()
				}
			}()
		}
		for _, nw := range []string{"udp4", "udp6"} {
			var c net.PacketConn
			if err := e.net.Do(func() (err error) {
				c, err = net.ListenPacket(nw, ":"+strconv.Itoa(p))
				return err
			}); err != nil {
				t.Fatalf("listen %s %d: %v", nw, p, err)
			}
			t.Cleanup(func() { c.Close() })
			go func() {
				buf := make([]byte, 64)
				for {
					if _, _, err := c.ReadFrom(buf); err != nil {
						return
					}
				}
			}()
		}
	}
}

func (e *env) dpConfig(detach bool) redirect.Config {
	return redirect.Config{
		Cgroup:       e.cg.Path,
		PinDir:       filepath.Join(e.bpffs, "meshdns"),
		Target4:      netip.AddrPortFrom(target4, basePort),
		Nameservers:  []netip.Addr{ns1},
		UpstreamMark: 0x3f53,
		Attribution:  true,
		EgressGrants: e.grantCap,
		Detach:       detach,
	}
}

// startDatapath starts a datapath on the test's cgroup and pins, in the
// namespace (as an agent there would). detach: Close removes everything;
// otherwise it is left pinned for the next one (the test removes the pins).
func (e *env) startDatapath(t testing.TB, detach bool) {
	t.Helper()
	d, err := redirect.New(e.dpConfig(detach))
	if err != nil {
		t.Fatalf("redirect.New: %v", err)
	}
	if err := e.net.Do(func() error { return d.Start(t.Context()) }); err != nil {
		t.Fatalf("datapath Start: %v", err)
	}
	e.dp = d
	pins := filepath.Join(e.bpffs, "meshdns")
	t.Cleanup(func() {
		e.resolver.OnRead(func(int) {})
		// With the resolver's sockets closed under it, unregistering them
		// fails (the kernel dropped them already): what redirect's own
		// fail-open tests ignore too.
		if err := d.Close(); err != nil && !e.resolverGone {
			t.Errorf("datapath Close: %v", err)
		}
		if !detach {
			if _, err := redirect.Cleanup(pins); err != nil {
				t.Errorf("remove pins: %v", err)
			}
		}
	})
}

// serve registers the fake resolver as the agent's resolver socket, and
// counts its reads as its progress: an agent that serves.
func (e *env) serve(t testing.TB) {
	t.Helper()
	udp, tcp := e.resolver.Conns()
	ap := netip.AddrPortFrom(target4, basePort)
	if err := e.dp.Serve([]redirect.Socket{{Addr: ap, Conn: udp}, {Addr: ap, TCP: true, Conn: tcp}}); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	e.resolver.OnRead(e.dp.Dequeued)
}

func (e *env) startEgress(t testing.TB, cfg Config) {
	t.Helper()
	cfg.Datapath = e.dp
	eg, err := New(cfg)
	if err != nil {
		t.Fatalf("egress.New: %v", err)
	}
	if err := eg.Start(t.Context()); err != nil {
		t.Fatalf("egress Start: %v", err)
	}
	t.Cleanup(func() {
		if err := eg.Close(); err != nil {
			t.Errorf("egress Close: %v", err)
		}
	})
	e.eg = eg
}

// workload makes a child cgroup of the test's, selected as id with r.
func (e *env) workload(t testing.TB, name string, id WorkloadID, r Rule) *testenv.Cgroup {
	t.Helper()
	cg := e.cg.Child(t, name)
	if err := e.eg.SetWorkload(cg.ID(t), id, r); err != nil {
		t.Fatal(err)
	}
	return cg
}

// try runs the client in cg as userUID with one attempt per target
// (kind/addr:port) and returns each target's result: "ok" or an errno name.
func (e *env) try(t testing.TB, cg *testenv.Cgroup, targets ...string) map[string]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := testenv.Command(ctx, testenv.Proc{Netns: e.net, Cgroup: cg, UID: userUID, GID: userUID}, clientBin, targets...)
	cmd.Env = append(os.Environ(), clientEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("client %v: %v\n%s%s", targets, err, out, stderr.String())
	}
	res := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok {
			res[k] = v
		}
	}
	return res
}

// want checks that each target of cg got the result in want ("ok", "EPERM").
func (e *env) want(t testing.TB, cg *testenv.Cgroup, want map[string]string) {
	t.Helper()
	targets := make([]string, 0, len(want))
	for k := range want {
		targets = append(targets, k)
	}
	got := e.try(t, cg, targets...)
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s from %s: %s, want %s", k, filepath.Base(cg.Path), got[k], w)
		}
	}
}

func dst(kind string, a netip.Addr, p uint16) string {
	return kind + "/" + netip.AddrPortFrom(a, p).String()
}

// counts returns workload id's counters.
func (e *env) counts(t testing.TB, id WorkloadID) Counts {
	t.Helper()
	c, err := e.eg.Counts()
	if err != nil {
		t.Fatal(err)
	}
	return c[id]
}

// nextEvent waits for the next event.
func (e *env) nextEvent(t testing.TB) Event {
	t.Helper()
	select {
	case ev, ok := <-e.eg.Events():
		if !ok {
			t.Fatal("events closed")
		}
		return ev
	case <-time.After(10 * time.Second):
		t.Fatal("no event within 10 s")
	}
	return Event{}
}
