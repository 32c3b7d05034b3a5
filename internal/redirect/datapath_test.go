package redirect

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Every client query style is captured, answered by the resolver slot of its
// nameserver, and sees the original nameserver as reply source and peer; each
// counts exactly once on the hook that handled it.
func TestRedirectClients(t *testing.T) {
	n := newTestNet(t)
	n.start(t, n.config())
	m1 := mapped(ns1)
	tests := []struct {
		name       string
		args       []string
		fam, slot  int
		src, peer  string
		fwdHook    string // hook that redirects
		fwdCounter string
		revHooks   []string // hooks that restore the original (reply_rewritten)
	}{
		{"go dial+read (connect4 udp)", []string{"-mode=godial", "-dst=" + hp(ns1, 53)}, 4, 0, "", "",
			"connect4", "redirected_udp", nil},
		{"connected udp recvfrom (connect4, recvmsg4, getpeername4)", []string{"-mode=connect", "-dst=" + hp(ns1, 53)}, 4, 0, hp(ns1, 53), hp(ns1, 53),
			"connect4", "redirected_udp", []string{"recvmsg4", "getpeername4"}},
		{"unconnected sendto (sendmsg4, recvmsg4)", []string{"-mode=sendto", "-dst=" + hp(ns1, 53)}, 4, 0, hp(ns1, 53), "",
			"sendmsg4", "redirected_udp", []string{"recvmsg4"}},
		{"tcp (connect4, getpeername4)", []string{"-mode=tcp", "-dst=" + hp(ns1, 53)}, 4, 0, "", hp(ns1, 53),
			"connect4", "redirected_tcp", []string{"getpeername4"}},
		// The kernel hands sendto(::ffff:a.b.c.d) on an AF_INET6 UDP socket to the
		// IPv4 sendmsg path (udpv6_sendmsg -> udp_sendmsg), so sendmsg4 sees it; the
		// reply goes through recvmsg6 and must come back v4-mapped.
		{"v6 socket to v4-mapped, sendto (sendmsg4, recvmsg6)", []string{"-mode=sendto", "-family=6", "-dst=" + hp(m1, 53)}, 4, 0, hp(m1, 53), "",
			"sendmsg4", "redirected_udp", []string{"recvmsg6"}},
		{"v6 socket to v4-mapped, connected (connect6, recvmsg6, getpeername6)", []string{"-mode=connect", "-family=6", "-dst=" + hp(m1, 53)}, 4, 0, hp(m1, 53), hp(m1, 53),
			"connect6", "redirected_udp", []string{"recvmsg6", "getpeername6"}},
		{"v6 socket to v4-mapped, tcp (connect6)", []string{"-mode=tcp", "-family=6", "-dst=" + hp(m1, 53)}, 4, 0, "", hp(m1, 53),
			"connect6", "redirected_tcp", []string{"getpeername6"}},
		{"v6 nameserver, sendto (sendmsg6 to target6)", []string{"-mode=sendto", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2, hp(ns6, 53), "",
			"sendmsg6", "redirected_udp", []string{"recvmsg6"}},
		{"v6 nameserver, connected (connect6 to target6)", []string{"-mode=connect", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2, hp(ns6, 53), hp(ns6, 53),
			"connect6", "redirected_udp", []string{"recvmsg6", "getpeername6"}},
		{"v6 nameserver, tcp", []string{"-mode=tcp", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2, "", hp(ns6, 53),
			"connect6", "redirected_tcp", []string{"getpeername6"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before, err := ReadStats(n.pinDir())
			if err != nil {
				t.Fatal(err)
			}
			origBefore := n.orig[ns1].Count("mesh.test") + n.orig[ns6].Count("mesh.test")
			rs := n.query(t, proc{uid: userUID}, tc.args...)
			if len(rs) != 1 {
				t.Fatalf("got %d results, want 1: %+v", len(rs), rs)
			}
			wantCaptured(t, rs[0], tc.fam, tc.slot, tc.src, tc.peer)
			if got := n.orig[ns1].Count("mesh.test") + n.orig[ns6].Count("mesh.test"); got != origBefore {
				t.Errorf("the original nameserver saw %d mesh.test queries, want none", got-origBefore)
			}
			after, err := ReadStats(n.pinDir())
			if err != nil {
				t.Fatal(err)
			}
			if got := counterOf(t, after, tc.fwdHook, tc.fwdCounter) - counterOf(t, before, tc.fwdHook, tc.fwdCounter); got != 1 {
				t.Errorf("%s %s went up by %d, want 1", tc.fwdHook, tc.fwdCounter, got)
			}
			for _, h := range tc.revHooks {
				if got := counterOf(t, after, h, "reply_rewritten") - counterOf(t, before, h, "reply_rewritten"); got < 1 {
					t.Errorf("%s reply_rewritten went up by %d, want at least 1", h, got)
				}
			}
			if got := counterOf(t, after, "total", "map_miss") - counterOf(t, before, "total", "map_miss"); got != 0 {
				t.Errorf("map_miss went up by %d", got)
			}
		})
	}
}

// One unconnected socket querying two captured nameservers gets each reply with
// its own nameserver as source (the map is keyed by socket and slot port).
func TestRedirectOneSocketTwoNameservers(t *testing.T) {
	n := newTestNet(t)
	n.start(t, n.config())
	for _, fam := range []int{4, 6} {
		t.Run(fmt.Sprintf("AF_INET%s", map[int]string{4: "", 6: "6"}[fam]), func(t *testing.T) {
			a, b := ns1, ns2
			if fam == 6 {
				a, b = mapped(ns1), mapped(ns2)
			}
			rs := n.query(t, proc{uid: userUID}, "-mode=sendto", fmt.Sprintf("-family=%d", fam),
				"-dst="+hp(a, 53)+","+hp(b, 53))
			if len(rs) != 2 {
				t.Fatalf("got %d results, want 2: %+v", len(rs), rs)
			}
			if rs[0].Socket != rs[1].Socket {
				t.Fatalf("queries used different sockets: %+v", rs)
			}
			wantCaptured(t, rs[0], 4, 0, hp(a, 53), "")
			wantCaptured(t, rs[1], 4, 1, hp(b, 53), "")
		})
	}
}

// Proxy UIDs and sockets carrying the upstream mark reach the original
// nameserver, whatever their UID; root without the mark is captured.
func TestRedirectExemptions(t *testing.T) {
	n := newTestNet(t)
	n.start(t, n.config())
	tests := []struct {
		name    string
		p       proc
		mode    string
		counter string // "" = captured
		hook    string
	}{
		{"proxy uid connected udp", proc{uid: proxyUID}, "connect", "skip_proxy", "connect4"},
		{"proxy uid sendto", proc{uid: proxyUID}, "sendto", "skip_proxy", "sendmsg4"},
		{"proxy uid tcp", proc{uid: proxyUID}, "tcp", "skip_proxy", "connect4"},
		{"root with upstream mark, connected udp", proc{uid: 0, mark: testMark}, "connect", "skip_resolver", "connect4"},
		{"root with upstream mark, tcp", proc{uid: 0, mark: testMark}, "tcp", "skip_resolver", "connect4"},
		{"root with upstream mark, sendto", proc{uid: 0, mark: testMark}, "sendto", "skip_resolver", "sendmsg4"},
		{"root with another mark is captured", proc{uid: 0, mark: testMark + 1}, "connect", "", "connect4"},
		{"root without mark is captured", proc{uid: 0}, "connect", "", "connect4"},
		{"root without mark, sendto, is captured", proc{uid: 0}, "sendto", "", "sendmsg4"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			counter := tc.counter
			if counter == "" {
				counter = "redirected_udp"
				if tc.mode == "tcp" {
					counter = "redirected_tcp"
				}
			}
			before := hookCounter(t, n.pinDir(), tc.hook, counter)
			origBefore := n.orig[ns1].Count("mesh.test")
			rs := n.query(t, tc.p, "-mode="+tc.mode, "-dst="+hp(ns1, 53))
			if len(rs) != 1 {
				t.Fatalf("got %d results, want 1", len(rs))
			}
			origSeen := n.orig[ns1].Count("mesh.test") - origBefore
			if tc.counter == "" {
				wantCaptured(t, rs[0], 4, 0, "", "")
				if origSeen != 0 {
					t.Errorf("original nameserver saw %d queries, want 0", origSeen)
				}
			} else {
				wantOriginal(t, rs[0])
				if origSeen != 1 {
					t.Errorf("original nameserver saw %d queries, want 1", origSeen)
				}
			}
			if got := hookCounter(t, n.pinDir(), tc.hook, counter) - before; got != 1 {
				t.Errorf("%s %s went up by %d, want 1", tc.hook, counter, got)
			}
		})
	}
}

// runDig runs dig in the test cgroup and namespace as the test user and returns
// its status and A answers.
func (n *testNet) runDig(t *testing.T, args ...string) (status string, answers []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := testenv.Command(ctx, testenv.Proc{Netns: n.node, Cgroup: n.cg, UID: userUID, GID: userUID},
		"dig", append([]string{"+tries=1", "+time=3", "+nocookie"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("dig %v: %v\n%s", args, err, out)
	}
	inAnswer := false
	for _, line := range strings.Split(string(out), "\n") {
		if i := strings.Index(line, "status: "); i >= 0 {
			status = strings.TrimSuffix(strings.Fields(line[i+len("status: "):])[0], ",")
		}
		if strings.HasPrefix(line, ";; ANSWER SECTION:") {
			inAnswer = true
			continue
		}
		if inAnswer {
			f := strings.Fields(line)
			if len(f) == 0 {
				inAnswer = false
				continue
			}
			if len(f) >= 5 && f[3] == "A" {
				answers = append(answers, f[4])
			}
		}
	}
	return status, answers
}

// dig @<an uncaptured address> is left alone by default and captured (to the
// capture-all slot) with CaptureAll; loopback destinations are never captured.
func TestRedirectCaptureAll(t *testing.T) {
	testenv.RequirePrivileged(t, "dig")
	for _, captureAll := range []bool{false, true} {
		t.Run(fmt.Sprintf("capture_all=%v", captureAll), func(t *testing.T) {
			n := newTestNet(t)
			cfg := n.config()
			cfg.CaptureAll = captureAll
			n.start(t, cfg)
			for _, proto := range []string{"+notcp", "+tcp"} {
				status, answers := n.runDig(t, proto, "@"+nsOther.String(), "mesh.test", "A")
				if captureAll {
					if status != "NOERROR" || len(answers) != 1 || answers[0] != resolverAnswer(4, 3) {
						t.Errorf("dig %s @%s with capture-all: %s %v, want NOERROR [%s] (capture-all slot)", proto, nsOther, status, answers, resolverAnswer(4, 3))
					}
				} else if status != "NXDOMAIN" {
					t.Errorf("dig %s @%s without capture-all: %s %v, want NXDOMAIN from that server", proto, nsOther, status, answers)
				}
				// A captured nameserver is captured either way.
				status, answers = n.runDig(t, proto, "@"+ns2.String(), "mesh.test", "A")
				if status != "NOERROR" || len(answers) != 1 || answers[0] != resolverAnswer(4, 1) {
					t.Errorf("dig %s @%s: %s %v, want NOERROR [%s]", proto, ns2, status, answers, resolverAnswer(4, 1))
				}
			}
			wantSkip := uint64(2)
			if captureAll {
				wantSkip = 0
			}
			if got := hookCounter(t, n.pinDir(), "total", "skip_not_captured"); got != wantSkip {
				t.Errorf("skip_not_captured = %d, want %d", got, wantSkip)
			}
			if got := n.orig[nsOther].Count("mesh.test"); got != int(wantSkip) {
				t.Errorf("%s saw %d queries, want %d", nsOther, got, wantSkip)
			}
			// Loopback: nothing listens on 127.0.0.53 in the namespace; the query must
			// go there (and fail), not to the resolver.
			rs := n.query(t, proc{uid: userUID}, "-mode=connect", "-dst=127.0.0.53:53")
			if len(rs) != 1 || rs[0].Err == "" {
				t.Errorf("query to 127.0.0.53:53 was answered: %+v", rs)
			}
			if got := hookCounter(t, n.pinDir(), "connect4", "skip_loopback"); got != 1 {
				t.Errorf("connect4 skip_loopback = %d, want 1", got)
			}
		})
	}
}

// queryLoop runs the client in loop mode for dur and returns its results.
func (n *testNet) queryLoop(t *testing.T, dur time.Duration) []clientResult {
	t.Helper()
	return n.query(t, proc{uid: userUID}, "-mode=loop", "-dst="+hp(ns1, 53), "-dur="+dur.String())
}

func isCaptured(r clientResult) bool {
	return r.Err == "" && r.Rcode == "NOERROR" && len(r.A) == 1 && r.A[0] == resolverAnswer(4, 0)
}

// The queries TestStats sends: connected UDP, sendto, TCP, and from the
// proxy UID (not captured).
const nUDP, nSendto, nTCP, nProxy = 25, 15, 10, 5

// Bad input gets a clear error and leaves nothing attached or pinned.
func TestInstallBadInput(t *testing.T) {
	n := newTestNet(t)
	notCgroup := t.TempDir()
	tests := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"missing cgroup dir", func(c *Config) { c.Cgroup = n.cg.Path + "-missing" }, "does not exist"},
		{"dir not on cgroup2", func(c *Config) { c.Cgroup = notCgroup }, "is not on a cgroup2 filesystem"},
		{"pin dir not on bpffs", func(c *Config) { c.PinDir = t.TempDir() + "/meshdns" }, "is not on a bpffs"},
		{"no target", func(c *Config) { c.Target4, c.Target6 = netip.AddrPort{}, netip.AddrPort{} }, "no resolver target"},
		{"zero upstream mark", func(c *Config) { c.UpstreamMark = 0 }, "upstream mark must be non-zero"},
		{"nothing captured", func(c *Config) { c.Nameservers = nil }, "nothing to capture"},
		{"different target ports", func(c *Config) { c.Target6 = netip.AddrPortFrom(target6, 99) }, "same port"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := n.config()
			tc.mod(&cfg)
			cfg.Detach = true
			d, err := New(cfg)
			if err == nil {
				err = d.Start(t.Context())
				d.Close()
			}
			if err == nil {
				t.Fatalf("New+Start succeeded, want an error containing %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want it to contain %q", err, tc.want)
			}
			t.Logf("error: %v", err)
			if got := attachedPrograms(t, n.cg); got != 0 {
				t.Errorf("%d programs attached after a failed Install", got)
			}
			if pins := pinsUnder(t, n.bpffs); len(pins) != 0 {
				t.Errorf("pins left after a failed Install: %v", pins)
			}
		})
	}

	// A failure half-way through attaching (another program holds recvmsg6
	// exclusively) removes the links and pins made so far, whether Close
	// would detach (Detach) or leave them for the next agent: a failed Start
	// releases through Close's path, as a discard.
	prog := passProgram(t, ebpf.CGroupSockAddr, ebpf.AttachCGroupUDP6Recvmsg)
	opts := link.RawAttachProgramOptions{Target: n.cg.FD(), Program: prog, Attach: ebpf.AttachCGroupUDP6Recvmsg}
	if err := link.RawAttachProgram(opts); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := link.RawDetachProgram(link.RawDetachProgramOptions{Target: n.cg.FD(), Program: prog, Attach: ebpf.AttachCGroupUDP6Recvmsg}); err != nil {
			t.Errorf("detach the exclusive program: %v", err)
		}
	}()
	for _, detach := range []bool{true, false} {
		t.Run(fmt.Sprintf("half-way detach=%v", detach), func(t *testing.T) {
			cfg := n.config()
			cfg.Detach = detach
			d, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = d.Start(t.Context())
			if err == nil || !strings.Contains(err.Error(), "cgroup/recvmsg6") {
				d.Close()
				t.Fatalf("Install with recvmsg6 taken: %v, want an attach error naming cgroup/recvmsg6", err)
			}
			t.Logf("error: %v", err)
			// Checked before Close: Start itself left nothing behind.
			if got := attachedPrograms(t, n.cg); got != 1 {
				t.Errorf("%d programs attached after a failed Install, want only the foreign one", got)
			}
			if pins := pinsUnder(t, n.bpffs); len(pins) != 0 {
				t.Errorf("pins left after a failed Install: %v", pins)
			}
			if err := d.Close(); err != nil {
				t.Errorf("Close after a failed Start: %v", err)
			}
		})
	}
}

// addPod creates a "pod" namespace joined to the node by a veth pair, with a
// default route to the node, and returns it.
func (n *testNet) addPod(t *testing.T) *testenv.Netns {
	t.Helper()
	pod := testenv.NewNetns(t, "mdpod")
	testenv.Veth(t, n.node, "mdn0", "10.99.0.1/24", pod, "eth0", "10.99.0.2/24")
	pod.IP(t, "route", "add", "default", "via", "10.99.0.1")
	return pod
}

func (n *testNet) queryIn(t *testing.T, ns *testenv.Netns, args ...string) []clientResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := testenv.Command(ctx, testenv.Proc{Netns: ns, Cgroup: n.cg, UID: userUID, GID: userUID}, clientBin, args...)
	cmd.Env = append(os.Environ(), clientEnv+"=1", "GODEBUG=asyncpreemptoff=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("client %v: %v\n%s%s", args, err, out, stderr.String())
	}
	return parseResults(t, out)
}

// A pod (another network namespace) is redirected to the node-local target; a
// loopback target is used only for sockets in the agent's own namespace, and
// pods are left alone (skip_other_netns) rather than sent to their own loopback.
func TestRedirectOtherNetns(t *testing.T) {
	t.Run("node-local target: pod captured", func(t *testing.T) {
		n := newTestNet(t)
		pod := n.addPod(t)
		n.start(t, n.config())
		for _, mode := range []string{"connect", "sendto", "tcp"} {
			rs := n.queryIn(t, pod, "-mode="+mode, "-dst="+hp(ns1, 53))
			src, peer := hp(ns1, 53), hp(ns1, 53)
			if mode == "tcp" {
				src = ""
			}
			if mode == "sendto" {
				peer = ""
			}
			wantCaptured(t, rs[0], 4, 0, src, peer)
		}
	})
	t.Run("loopback target: only the agent's netns", func(t *testing.T) {
		n := newTestNet(t)
		pod := n.addPod(t)
		loop := netip.MustParseAddr("127.0.0.1")
		loopResolver := testenv.StartFakeDNS(t, n.node, hp(loop, testBasePort),
			map[string][]netip.Addr{"mesh.test": {netip.MustParseAddr("10.53.127.0")}})
		cfg := n.config()
		cfg.Target4 = netip.AddrPortFrom(loop, testBasePort)
		cfg.Target6 = netip.AddrPort{}
		cfg.Nameservers = []netip.Addr{ns1}
		cfg.Detach = true
		d, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// The agent runs in the node namespace: Start takes its netns cookie.
		if err := n.node.Do(func() error { return d.Start(t.Context()) }); err != nil {
			t.Fatalf("Start: %v", err)
		}
		t.Cleanup(func() { d.Close() })
		udp, tcp := loopResolver.Conns()
		if err := d.Serve([]Socket{{Addr: cfg.Target4, Conn: udp}, {Addr: cfg.Target4, TCP: true, Conn: tcp}}); err != nil {
			t.Fatal(err)
		}
		loopResolver.OnRead(d.Dequeued)
		rs := n.query(t, proc{uid: userUID}, "-mode=connect", "-dst="+hp(ns1, 53))
		if r := rs[0]; r.Err != "" || len(r.A) != 1 || r.A[0] != "10.53.127.0" || r.Src != hp(ns1, 53) {
			t.Errorf("node client: %+v, want the loopback resolver's answer from %s", r, hp(ns1, 53))
		}
		wantOriginal(t, n.queryIn(t, pod, "-mode=connect", "-dst="+hp(ns1, 53))[0])
		wantOriginal(t, n.queryIn(t, pod, "-mode=sendto", "-dst="+hp(ns1, 53))[0])
		if got := hookCounter(t, n.pinDir(), "connect4", "skip_other_netns"); got != 1 {
			t.Errorf("connect4 skip_other_netns = %d, want 1", got)
		}
		if got := hookCounter(t, n.pinDir(), "sendmsg4", "skip_other_netns"); got != 1 {
			t.Errorf("sendmsg4 skip_other_netns = %d, want 1", got)
		}
	})
}

// buildMusl compiles testdata/gai.c with musl-gcc into a directory every UID can
// read.
func buildMusl(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "meshdns-redirect-musl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := dir + "/gai"
	if out, err := exec.Command("musl-gcc", "-static", "-O2", "-o", bin, "testdata/gai.c").CombinedOutput(); err != nil {
		t.Fatalf("musl-gcc: %v\n%s", err, out)
	}
	return bin
}

// The system resolvers accept the redirected answers (they check the reply
// source): glibc's getent (connected UDP, A and AAAA in parallel on one socket)
// and musl's getaddrinfo (unconnected sendto to every nameserver; with an IPv6
// nameserver in resolv.conf, one AF_INET6 socket and v4-mapped IPv4 nameservers).
func TestSystemResolvers(t *testing.T) {
	testenv.RequirePrivileged(t, "getent", "musl-gcc")
	n := newTestNet(t)
	n.start(t, n.config())
	musl := buildMusl(t)
	v4slot0, v6slot2 := resolverAnswer(4, 0), resolverAnswer(6, 2)
	tests := []struct {
		name      string
		resolv    string
		argv      []string
		wantOneOf []string // the answer of any captured nameserver's slot
	}{
		{"glibc getent, v4 nameserver", "nameserver 169.254.53.1\n", []string{"getent", "ahostsv4", "mesh.test"}, []string{v4slot0}},
		{"glibc getent, v6 nameserver", "nameserver fd53::1\n", []string{"getent", "ahostsv4", "mesh.test"}, []string{v6slot2}},
		{"glibc getent ahosts (A+AAAA)", "nameserver 169.254.53.1\n", []string{"getent", "ahosts", "mesh.test"}, []string{v4slot0}},
		{"musl, v4 nameserver", "nameserver 169.254.53.1\n", []string{musl, "mesh.test"}, []string{v4slot0}},
		{"musl, v6 and v4-mapped nameservers", "nameserver fd53::1\nnameserver 169.254.53.1\n", []string{musl, "mesh.test"}, []string{v4slot0, v6slot2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n.node.SetResolvConf(t, tc.resolv)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			out, err := testenv.Command(ctx, testenv.Proc{Netns: n.node, Cgroup: n.cg, UID: userUID, GID: userUID}, tc.argv[0], tc.argv[1:]...).CombinedOutput()
			took := time.Since(start)
			if err != nil {
				t.Fatalf("%v: %v\n%s", tc.argv, err, out)
			}
			fields := strings.Fields(string(out))
			if len(fields) == 0 || !containsString(tc.wantOneOf, fields[0]) {
				t.Errorf("%v answered %q, want one of %v from the resolver", tc.argv, out, tc.wantOneOf)
			}
			// A dropped reply would show as a resolver timeout (seconds).
			if took > 2*time.Second {
				t.Errorf("%v took %v: a reply was probably dropped", tc.argv, took)
			}
		})
	}
	if got := hookCounter(t, n.pinDir(), "total", "map_miss"); got != 0 {
		t.Errorf("map_miss = %d", got)
	}
}

func containsString(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
