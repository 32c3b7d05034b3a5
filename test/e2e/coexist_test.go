package e2e

import (
	"encoding/json"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/redirect/socklb"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The backends the tests' socket LB translates the captured nameservers to (a
// CoreDNS pod behind the kube-dns ClusterIP): they answer what the original
// nameservers answer, never the mesh names only the agent knows.
const (
	backendNS  = "169.254.53.50"
	backendNS6 = "fd53::50"
)

// The agent beside a socket load balancer on its capture cgroup that does what
// Cilium's socket LB does (the captured nameservers -> a backend, restored on
// recvmsg and getpeername), and its TCP-only variant (Calico's
// bpfConnectTimeLoadBalancing: TCP): attached before the agent, its programs
// go in front (ordered attach); attached after, they run first anyway. glibc,
// Go, musl and dig over UDP and TCP, on the node and in pods, get the mesh
// name only our resolver knows, each accepting an answer only from the
// address it asked. With the LB present, an overlapped upgrade and a kill -9
// and restart keep ours in front; after an uninstall the LB alone translates
// again. (Capture after the LB's translation, which needs the cluster DNS
// Service's EndpointSlices, is tested in test/kube.)
func TestCaptureBesideSocketLB(t *testing.T) {
	for _, tc := range []struct {
		name           string
		tcpOnly, after bool
	}{
		{"lb first", false, false},
		{"lb after", false, true},
		{"tcp-only lb first", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			n.ns.IP(t, "addr", "add", backendNS+"/32", "dev", "lo")
			n.ns.IP(t, "-6", "addr", "add", backendNS6+"/128", "dev", "lo", "nodad")
			records := map[string][]netip.Addr{extName: {netip.MustParseAddr(extIP)}}
			backend := testenv.StartFakeDNS(t, n.ns, backendNS+":53", records)
			backend6 := testenv.StartFakeDNS(t, n.ns, "["+backendNS6+"]:53", records)
			attach := func() *socklb.LB {
				lb, err := socklb.Attach(n.cg.Path, socklb.Options{TCPOnly: tc.tcpOnly, Services: map[netip.AddrPort]netip.AddrPort{
					netip.MustParseAddrPort(origNS + ":53"):         netip.MustParseAddrPort(backendNS + ":53"),
					netip.MustParseAddrPort("[" + origNS6 + "]:53"): netip.MustParseAddrPort("[" + backendNS6 + "]:53"),
				}})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { lb.Close() })
				return lb
			}
			var lb *socklb.LB
			if !tc.after {
				lb = attach()
			}
			n.start("ebpf")
			if tc.after {
				lb = attach()
			}
			suite := func(what string) {
				t.Run(what, func(t *testing.T) {
					t.Run("pod", func(t *testing.T) { runClients(t, n, n.pod, 1000, clientSuite()) })
					t.Run("node", func(t *testing.T) { runClients(t, n, n.ns, 1000, clientSuite()) })
					t.Run("ipv6-nameserver", func(t *testing.T) {
						runClients(t, n, n.pod6, 1000, []clientCase{
							{"dig-udp", []string{"dig", "+short", "+time=2", "+tries=1", "AAAA", meshName6}, has(meshIP6)},
							{"dig-tcp", []string{"dig", "+tcp", "+short", "+time=2", "+tries=1", "AAAA", meshName6}, has(meshIP6)},
							{"glibc", []string{"getent", "ahosts", meshName6}, has(meshIP6)},
						})
					})
					n.wantCaptureFirst(t)
				})
			}
			suite("clients")
			if tc.after {
				return
			}
			n.upgrade("ebpf")
			suite("after an upgrade")
			n.agent.Kill()
			n.agent = nil
			n.start("ebpf")
			suite("after kill -9 and a restart")

			// Uninstalled: the LB alone translates the pod's queries again.
			n.stop()
			before := backend.Count(extName) + backend6.Count(extName)
			translated := lb.Translated()
			for _, c := range []clientCase{
				{"dig-tcp", []string{"dig", "+tcp", "+short", "+time=2", "+tries=1", extName}, has(extIP)},
				{"glibc", []string{"getent", "ahosts", extName}, has(extIP)},
			} {
				out, err := n.client(n.pod, 1000, c.argv[0], c.argv[1:]...)
				if err != nil || !c.want(out) {
					t.Errorf("after uninstall, %s: %v %q", c.name, err, out)
				}
			}
			if lb.Translated() == translated || backend.Count(extName)+backend6.Count(extName) == before {
				t.Errorf("after uninstall the LB translated nothing to its backends")
			}
		})
	}
}

// wantCaptureFirst checks that status says ours run first on every forward
// hook (ordering).
func (n *node) wantCaptureFirst(t *testing.T) {
	t.Helper()
	out, err := n.cli("status", "-o", "json", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	var st struct {
		Datapath struct {
			Capture []struct {
				Hook      string `json:"hook"`
				First     bool   `json:"first"`
				Mechanism string `json:"mechanism"`
			} `json:"capture"`
		} `json:"datapath"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	if len(st.Datapath.Capture) != 4 {
		t.Fatalf("status -o json: capture %+v, want the 4 forward hooks\n%s", st.Datapath.Capture, out)
	}
	for _, hc := range st.Datapath.Capture {
		if !hc.First || hc.Mechanism != "ordering" {
			t.Errorf("status: %+v, want ours first by ordering", hc)
		}
	}
	text, err := n.cli("status", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if err != nil || !strings.Contains(text, "OURS FIRST") {
		t.Errorf("status text has no OURS FIRST table (%v):\n%s", err, text)
	}
	code, metrics := n.httpGet("http://" + adminAddr + "/metrics")
	for _, want := range []string{
		`meshdns_datapath_capture_mechanism{hook="connect4",mechanism="ordering"} 1`,
		`meshdns_datapath_capture_mechanism{hook="sendmsg4",mechanism="none"} 0`,
	} {
		if code != 200 || !strings.Contains(metrics, want) {
			t.Errorf("/metrics (%d) lacks %s", code, want)
		}
	}
}

// Rollouts and a kill -9 under load with the socket LB attached before the
// agent (ours in front): 5 overlapped upgrades lose nothing, no mesh name
// falls through to a backend, and no reply comes from the wrong source; after
// a kill -9 the only failed lookups are those in flight at the kill (lookups
// started after it reach the backend through the LB, which knows no mesh
// name), and a restarted agent captures again.
func TestRolloutsBesideSocketLBUnderLoad(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	n.ns.IP(t, "addr", "add", backendNS+"/32", "dev", "lo")
	backend := testenv.StartFakeDNS(t, n.ns, backendNS+":53", map[string][]netip.Addr{
		extName:         {netip.MustParseAddr(extIP)},
		"*." + fwdZone:  {netip.MustParseAddr(fwdIP)},
		"*." + slowZone: {netip.MustParseAddr(slowIP)},
	})
	backend.SetNameDelay("*."+slowZone, slowDelay)
	lb, err := socklb.Attach(n.cg.Path, socklb.Options{Services: map[netip.AddrPort]netip.AddrPort{
		netip.MustParseAddrPort(origNS + ":53"): netip.MustParseAddrPort(backendNS + ":53")}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lb.Close() })
	n.start("ebpf")
	missBefore := n.mapMiss()
	ld := n.startLoad(pod, 1000)
	origin := monotonic()
	n.waitRedirected(500)
	const rounds = 5
	for range rounds {
		n.upgrade("ebpf")
	}
	upgraded := monotonic()
	missUpgrades := n.mapMiss() - missBefore
	n.waitRedirected(500)
	victim := n.agent
	if err := victim.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if ok, _ := victim.Wait(10 * time.Second); !ok {
		t.Fatal("the killed agent did not exit")
	}
	killed := monotonic()
	n.agent = nil
	backend.Reset()
	if !testenv.WaitFor(30*time.Second, func() bool { return len(backend.Queries()) >= 500 }) {
		t.Fatalf("the backend saw only %d queries through the LB after the kill", len(backend.Queries()))
	}
	n.start("ebpf")
	restarted := monotonic()
	n.waitRedirected(500)
	n.wantCaptureFirst(t)
	res := ld.stop()

	upFell, upBad := split(res.between(0, upgraded))
	var inFlight int
	var bad []loadFail
	for _, f := range res.between(upgraded, monotonic()) {
		switch {
		case f.start < killed:
			inFlight++
		case f.what == "nxdomain" && isMesh(f.name) && f.start < restarted:
			// No agent: the backend (through the LB) answered; the fail-open.
		default:
			bad = append(bad, f)
		}
	}
	t.Logf("beside the LB, %d lookups (%d ok): %d upgrades: %d lost or wrong, %d fell through, %d wrong-source replies; kill -9: %d in flight failed, %d started after it failed",
		res.sent, res.ok, rounds, len(upBad), len(upFell), missUpgrades, inFlight, len(bad))
	if len(upBad)+len(upFell) > 0 || missUpgrades > 0 {
		t.Errorf("upgrades beside the LB: %d lost or wrong, %d fell through, %d wrong-source replies, want 0:\n%s%s",
			len(upBad), len(upFell), missUpgrades, describe(upBad, origin), describe(upFell, origin))
	}
	if len(bad) > 0 {
		t.Errorf("lookups started after the kill failed:\n%s", describe(bad, killed))
	}
}
