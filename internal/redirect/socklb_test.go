package redirect

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/redirect/socklb"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Backends of the captured nameservers behind the tests' socket LB (a CoreDNS
// pod behind the kube-dns ClusterIP): they answer mesh.test with NXDOMAIN, as
// the original nameservers do.
var (
	backend4 = others[1]
	backend6 = netip.MustParseAddr("fd53::b0")
)

// lbClients are the ways a client asks, with what each sees of the reply: its
// source (recvmsg) and the socket's peer (getpeername).
func lbClients() []struct {
	name      string
	args      []string
	fam, slot int
	src, peer string
	tcp       bool
} {
	return []struct {
		name      string
		args      []string
		fam, slot int
		src, peer string
		tcp       bool
	}{
		{"glibc-like connected udp", []string{"-mode=connect", "-dst=" + hp(ns1, 53)}, 4, 0, hp(ns1, 53), hp(ns1, 53), false},
		{"musl-like sendto", []string{"-mode=sendto", "-dst=" + hp(ns1, 53)}, 4, 0, hp(ns1, 53), "", false},
		{"go dial", []string{"-mode=godial", "-dst=" + hp(ns1, 53)}, 4, 0, "", "", false},
		{"tcp", []string{"-mode=tcp", "-dst=" + hp(ns1, 53)}, 4, 0, "", hp(ns1, 53), true},
		{"v6 connected udp", []string{"-mode=connect", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2, hp(ns6, 53), hp(ns6, 53), false},
		{"v6 sendto", []string{"-mode=sendto", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2, hp(ns6, 53), "", false},
		{"v6 tcp", []string{"-mode=tcp", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2, "", hp(ns6, 53), true},
		{"v4-mapped sendto", []string{"-mode=sendto", "-family=6", "-dst=" + hp(mapped(ns1), 53)}, 4, 0, hp(mapped(ns1), 53), "", false},
	}
}

// Capture beside a socket load balancer that translates the captured
// nameservers (the kube-dns ClusterIP) to a backend, as Cilium's socket LB and
// Calico's connect-time LB do, on the same cgroup, for clients in a pod:
//   - attached before ours: ours go in front (ordered attach);
//   - attached after ours: ours run first anyway;
//   - attached before ours on a kernel without ordered attach (the test
//     switch), or after ours but in front of them (BPF_F_BEFORE): the LB
//     translates first and ours capture the backend (backend capture);
//
// and each with the TCP-only variant (Calico's bpfConnectTimeLoadBalancing:
// TCP). Every query is answered by our resolver, and the client sees the
// address it asked as reply source and peer, never the backend's. The LB still
// works on its own once ours are gone.
func TestCaptureBesideSocketLB(t *testing.T) {
	for _, tcpOnly := range []bool{false, true} {
		for _, tc := range []struct {
			name                      string
			after, unordered, lbFirst bool
			backend                   bool // captured after the LB's translation
		}{
			{"lb first", false, false, false, false},
			{"lb after", true, false, false, false},
			{"lb first, unordered", false, true, false, true},
			{"lb after, in front of ours", true, false, true, true},
		} {
			name := tc.name
			if tcpOnly {
				name = "tcp-only " + name
			}
			t.Run(name, func(t *testing.T) {
				n := newLBNet(t)
				var lb *socklb.LB
				if !tc.after {
					lb = n.attachLB(t, tcpOnly, tc.lbFirst)
				}
				cfg := n.config()
				cfg.Unordered = tc.unordered
				d := n.start(t, cfg)
				if tc.unordered {
					n.wantCapture(t, d, false, MechanismNone)
				}
				if err := d.SetBackends(map[netip.Addr]netip.Addr{backend4: ns1, backend6: ns6}); err != nil {
					t.Fatal(err)
				}
				if tc.after {
					lb = n.attachLB(t, tcpOnly, tc.lbFirst)
				}
				if tc.backend {
					n.wantCapture(t, d, false, MechanismBackendCapture)
				} else {
					n.wantCapture(t, d, true, MechanismOrdering)
				}
				for _, c := range lbClients() {
					t.Run(c.name, func(t *testing.T) {
						before := n.orig[backend4].Count("mesh.test") + n.orig[backend6].Count("mesh.test")
						rs := n.queryIn(t, n.pod, c.args...)
						if len(rs) != 1 {
							t.Fatalf("got %d results, want 1: %+v", len(rs), rs)
						}
						wantCaptured(t, rs[0], c.fam, c.slot, c.src, c.peer)
						if got := n.orig[backend4].Count("mesh.test") + n.orig[backend6].Count("mesh.test"); got != before {
							t.Errorf("a backend saw %d queries, want none", got-before)
						}
					})
				}
				s, err := ReadStats(n.pinDir())
				if err != nil {
					t.Fatal(err)
				}
				captured := counterOf(t, s, "total", "backend_captured")
				if tc.backend {
					if lb.Translated() == 0 || captured == 0 {
						t.Errorf("the LB translated %d queries, ours captured %d backends: want both, the LB running first", lb.Translated(), captured)
					}
				} else if lb.Translated() != 0 || captured != 0 {
					t.Errorf("the LB translated %d queries, ours captured %d backends: want none, ours running first", lb.Translated(), captured)
				}
				if tc.backend {
					n.wantBackendOwnQuery(t)
					n.wantMarkedNotCaptured(t)
				}
				// Without ours, the LB translates and restores on its own.
				if err := d.Close(); err != nil {
					t.Fatal(err)
				}
				n.wantLBAlone(t, lb, tcpOnly)
			})
		}
	}
}

// wantCapture checks what the datapath and status (from the pins: text and
// JSON) say of every forward hook: whether ours run first, and the mechanism.
func (n lbNet) wantCapture(t *testing.T, d *Datapath, first bool, mechanism string) {
	t.Helper()
	hcs, err := d.HookCaptures()
	if err != nil {
		t.Fatal(err)
	}
	st, err := ReadStatus(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	for what, got := range map[string][]HookCapture{"datapath": hcs, "status": st.Capture} {
		if len(got) != 4 {
			t.Errorf("%s: %d forward hooks, want 4: %+v", what, len(got), got)
		}
		for _, hc := range got {
			if hc.First != first || hc.Mechanism != mechanism {
				t.Errorf("%s: %+v, want first %v by %s", what, hc, first, mechanism)
			}
		}
	}
	var text strings.Builder
	if err := st.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(text.String(), "OURS FIRST") || !regexp.MustCompile(`connect4 +`+map[bool]string{true: "yes", false: "no"}[first]+` +`+mechanism).MatchString(text.String()) {
		t.Errorf("status text does not say connect4 runs first=%v by %s:\n%s", first, mechanism, text.String())
	}
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf(`{"hook":"sendmsg4","first":%v,"mechanism":%q}`, first, mechanism); !strings.Contains(string(b), want) {
		t.Errorf("status JSON lacks %s: %s", want, b)
	}
}

// wantMarkedNotCaptured checks that a socket carrying the upstream mark (the
// agent's own upstream query) to a captured nameserver, translated to its
// backend by the LB, reaches the backend.
func (n lbNet) wantMarkedNotCaptured(t *testing.T) {
	t.Helper()
	before := n.orig[backend4].Count("mesh.test")
	// Root: setting SO_MARK takes CAP_NET_ADMIN. TCP: both LB variants translate it.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := testenv.Command(ctx, testenv.Proc{Netns: n.pod, Cgroup: n.cg}, clientBin, "-mode=tcp", "-dst="+hp(ns1, 53), fmt.Sprintf("-mark=%d", testMark))
	cmd.Env = append(os.Environ(), clientEnv+"=1", "GODEBUG=asyncpreemptoff=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("marked client: %v\n%s", err, out)
	}
	rs := parseResults(t, out)
	if len(rs) != 1 {
		t.Fatalf("got %d results", len(rs))
	}
	wantOriginal(t, rs[0])
	if n.orig[backend4].Count("mesh.test") != before+1 {
		t.Errorf("the marked query did not reach the backend")
	}
}

// wantBackendOwnQuery checks that a query from the network namespace where the
// backend is served (a CoreDNS pod asking through the ClusterIP, translated to
// itself) is not captured.
func (n lbNet) wantBackendOwnQuery(t *testing.T) {
	t.Helper()
	before := n.orig[backend4].Count("mesh.test")
	rs := n.query(t, proc{uid: userUID}, "-mode=tcp", "-dst="+hp(ns1, 53))
	if len(rs) != 1 {
		t.Fatalf("got %d results", len(rs))
	}
	wantOriginal(t, rs[0])
	if n.orig[backend4].Count("mesh.test") != before+1 {
		t.Errorf("the backend's own query did not reach the backend")
	}
}

type lbNet struct {
	*testNet
	pod *testenv.Netns // the clients' network namespace
}

// newLBNet is the test network with a v6 backend too, and a pod reaching the
// node over IPv4 and IPv6.
func newLBNet(t *testing.T) lbNet {
	t.Helper()
	n := newTestNet(t)
	n.node.IP(t, "-6", "addr", "add", backend6.String()+"/128", "dev", "lo", "nodad")
	n.orig[backend6] = testenv.StartFakeDNS(t, n.node, netip.AddrPortFrom(backend6, 53).String(), nil)
	pod := n.addPod(t)
	n.node.IP(t, "-6", "addr", "add", "fd99::1/64", "dev", "mdn0", "nodad")
	pod.IP(t, "-6", "addr", "add", "fd99::2/64", "dev", "eth0", "nodad")
	pod.IP(t, "-6", "route", "add", "default", "via", "fd99::1")
	return lbNet{n, pod}
}

// attachLB attaches the tests' socket LB to the test cgroup, translating ns1
// and ns6 (port 53) to their backends.
func (n lbNet) attachLB(t *testing.T, tcpOnly, first bool) *socklb.LB {
	t.Helper()
	lb, err := socklb.Attach(n.cg.Path, socklb.Options{
		Services: map[netip.AddrPort]netip.AddrPort{
			netip.AddrPortFrom(ns1, 53): netip.AddrPortFrom(backend4, 53),
			netip.AddrPortFrom(ns6, 53): netip.AddrPortFrom(backend6, 53),
		},
		TCPOnly: tcpOnly,
		First:   first,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lb.Close() })
	return lb
}

// wantLBAlone checks that, with no datapath of ours, the LB sends the clients'
// queries to the backends (all of them, or TCP only) and restores the Service
// address they asked.
func (n lbNet) wantLBAlone(t *testing.T, lb *socklb.LB, tcpOnly bool) {
	t.Helper()
	for _, c := range lbClients() {
		before := n.orig[backend4].Count("mesh.test") + n.orig[backend6].Count("mesh.test")
		rs := n.queryIn(t, n.pod, c.args...)
		if len(rs) != 1 {
			t.Fatalf("%s without ours: got %d results", c.name, len(rs))
		}
		wantOriginal(t, rs[0])
		r := rs[0]
		if c.src != "" && r.Src != c.src || c.peer != "" && r.Peer != c.peer {
			t.Errorf("%s without ours: source %q peer %q, want %q %q", c.name, r.Src, r.Peer, c.src, c.peer)
		}
		translated := n.orig[backend4].Count("mesh.test")+n.orig[backend6].Count("mesh.test") > before
		if want := c.tcp || !tcpOnly; translated != want {
			t.Errorf("%s without ours: reached the backend %v, want %v", c.name, translated, want)
		}
	}
	if lb.Translated() == 0 {
		t.Error(fmt.Sprintf("the LB translated nothing on its own (restored %d)", lb.Restored()))
	}
}
