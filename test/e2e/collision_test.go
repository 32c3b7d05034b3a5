package e2e

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone/ctzonetest"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// TestCollisionEBPF: the collision workload in eBPF mode. The workload that makes Istio's
// pre-1.11 REDIRECT rules misroute a quarter of the mesh queries (see
// internal/ctzone TestCollisionBugIstioPre111: a narrow port range, app and proxy
// sharing source ports) runs with the eBPF datapath instead: 0 of 10,000 mesh queries
// are misrouted, and no NAT conntrack entry exists, because the destination is
// rewritten in connect() before conntrack sees the packet.
func TestCollisionEBPF(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "setpriv", "iptables")
	const mesh = 10000
	var proxyPins string
	r := ctzonetest.Run(t, ctzonetest.Scenario{
		Capture: func(t *testing.T, tp *ctzonetest.Topology) {
			// Make conntrack track every flow of the pod (no NAT, no zone), so
			// "no NAT entry" below is a statement about real entries.
			tp.Pod.Exec(t, "iptables", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "INVALID", "-j", "DROP")
			pins := testenv.NewBPFFS(t)
			dp, err := redirect.New(redirect.Config{
				Cgroup:       tp.Cgroup.Path,
				PinDir:       pins + "/meshdns",
				Target4:      ctzonetest.ProxyListen,
				Nameservers:  []netip.Addr{tp.Nameserver},
				ProxyUIDs:    []uint32{ctzonetest.ProxyUID},
				UpstreamMark: ctzone.DefaultUpstreamMark,
				Detach:       true,
			})
			if err != nil {
				t.Fatal(err)
			}
			// Started from inside the pod's namespace: the loopback target (the
			// sidecar proxy's 127.0.0.1:15053) is valid there.
			if err := tp.Pod.Do(func() error { return dp.Start(context.Background()) }); err != nil {
				t.Fatalf("start datapath: %v", err)
			}
			t.Cleanup(func() {
				if err := dp.Close(); err != nil {
					t.Errorf("close datapath: %v", err)
				}
			})
			// The proxy (uid 1337) registers its own sockets as the resolver and
			// reports its reads: let it open the two maps that takes.
			for _, p := range []string{filepath.Dir(pins), pins, pins + "/meshdns", pins + "/meshdns/maps"} {
				if err := os.Chmod(p, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			for _, m := range []string{"config", "resolver_socks", "progress"} {
				if err := os.Chown(pins+"/meshdns/maps/"+m, ctzonetest.ProxyUID, ctzonetest.ProxyUID); err != nil {
					t.Fatal(err)
				}
			}
			proxyPins = pins + "/meshdns"
		},
		Proxy: ctzonetest.ProxyOptions{UID: ctzonetest.ProxyUID, GID: ctzonetest.ProxyUID, Register: func() string { return proxyPins }},
		App:   ctzonetest.AppOptions{Mesh: mesh, Timeout: 2 * time.Second},
		After: func(t *testing.T, tp *ctzonetest.Topology, r ctzonetest.Result) {
			var st *ctzone.ConntrackStatus
			if err := tp.Pod.Do(func() (err error) { st, err = ctzone.ReadConntrackStatus(); return err }); err != nil {
				t.Fatalf("read conntrack: %v", err)
			}
			var b strings.Builder
			_ = st.WriteTable(&b)
			t.Logf("conntrack in the pod:\n%s", b.String())
			entries, nated := 0, 0
			for _, z := range st.Zones {
				entries += z.Entries
				nated += z.NATed
			}
			if entries == 0 {
				t.Errorf("conntrack tracked no port-53 flow in the pod: the no-NAT check would prove nothing")
			}
			if nated != 0 {
				t.Errorf("%d port-53 conntrack entries are NATed in eBPF mode, want 0", nated)
			}
		},
	})
	if r.Mesh != mesh || r.MeshOK != mesh || r.Misrouted != 0 {
		t.Errorf("eBPF mode: %s; want all %d mesh queries answered by the proxy, 0 misrouted", r, mesh)
	}
	if r.SharedPorts == 0 {
		t.Errorf("the app and the proxy never shared a source port, so collisions were not exercised: %s", r)
	}
}
