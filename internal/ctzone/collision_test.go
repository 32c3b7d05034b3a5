package ctzone

import (
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone/ctzonetest"
)

// istioPre111 installs the DNS capture of Istio before 1.11 (the rules of the
// Beat blog post, issue 33469): proxy UID/GID RETURN, then REDIRECT to 15053,
// no conntrack zones.
func istioPre111(t *testing.T, tp *ctzonetest.Topology) {
	for _, rule := range [][]string{
		{"-p", "udp", "--dport", "53", "-m", "owner", "--uid-owner", strconv.Itoa(ctzonetest.ProxyUID), "-j", "RETURN"},
		{"-p", "udp", "--dport", "53", "-m", "owner", "--gid-owner", strconv.Itoa(ctzonetest.ProxyUID), "-j", "RETURN"},
		{"-p", "udp", "-d", tp.Nameserver.String() + "/32", "--dport", "53", "-j", "REDIRECT", "--to-ports", "15053"},
	} {
		tp.Pod.Exec(t, "iptables", append([]string{"-w", "-t", "nat", "-A", "OUTPUT"}, rule...)...)
	}
}

// meshdnsCapture installs our iptables mode in the pod namespace, runs the
// repair loop, and closes it at cleanup.
func meshdnsCapture(cfg Config) func(t *testing.T, tp *ctzonetest.Topology) {
	return func(t *testing.T, tp *ctzonetest.Topology) {
		cfg.ListenAddr = ctzonetest.ProxyListen
		cfg.Nameservers = []netip.Addr{tp.Nameserver}
		cfg.Logger = testLogger(t)
		var r *Rules
		err := tp.Pod.Do(func() (err error) {
			r, err = install(cfg)
			return err
		})
		if err != nil {
			t.Fatalf("install: %v", err)
		}
		t.Cleanup(func() {
			if err := r.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
		t.Logf("rules:\n%s", saveOurs(t, tp.Pod.Name, r.Backend(), false))
	}
}

// TestCollisionBugIstioPre111 proves that the workload detects the bug: with
// Istio's pre-1.11 rules on this kernel, mesh queries that reuse the 4-tuple of
// a recent proxy upstream query skip the REDIRECT and reach the upstream,
// which answers NXDOMAIN.
func TestCollisionBugIstioPre111(t *testing.T) {
	r := ctzonetest.Run(t, ctzonetest.Scenario{
		Capture: istioPre111,
		Proxy:   ctzonetest.ProxyOptions{UID: ctzonetest.ProxyUID, GID: ctzonetest.ProxyUID},
		App:     ctzonetest.AppOptions{Mesh: 2000},
		After: func(t *testing.T, tp *ctzonetest.Topology, _ ctzonetest.Result) {
			logConntrack(t, tp)
		},
	})
	if r.Misrouted == 0 {
		t.Fatalf("no mesh query was misrouted with Istio's pre-1.11 rules: the workload cannot show the bug: %s", r)
	}
	if r.UpstreamMesh == 0 {
		t.Errorf("the app got NXDOMAIN for %d mesh queries but the upstream saw none", r.Misrouted)
	}
	if r.SharedPorts == 0 {
		t.Errorf("the app and the proxy's upstream queries never shared a source port: %s", r)
	}
	t.Logf("bug reproduced: %d of %d mesh queries (%.1f%%) misrouted to the upstream", r.Misrouted, r.Mesh, 100*r.MisroutedShare())
}

// TestCollisionZones runs the same workload with our iptables mode: the
// proxy's upstream flows are recognised by its UID (as Istio's are) or by the
// upstream mark (as the resolver's are), and every one of 10,000 mesh queries
// must be answered by the proxy although the 4-tuples keep colliding.
func TestCollisionZones(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   Config
		proxy ctzonetest.ProxyOptions
	}{
		{"proxy-uid", Config{ProxyUIDs: []uint32{ctzonetest.ProxyUID}, ProxyGIDs: []uint32{ctzonetest.ProxyUID}},
			ctzonetest.ProxyOptions{UID: ctzonetest.ProxyUID, GID: ctzonetest.ProxyUID}},
		{"upstream-mark", Config{UpstreamMark: DefaultUpstreamMark},
			ctzonetest.ProxyOptions{Mark: DefaultUpstreamMark}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const mesh = 10000
			r := ctzonetest.Run(t, ctzonetest.Scenario{
				Capture: meshdnsCapture(tc.cfg),
				Proxy:   tc.proxy,
				App:     ctzonetest.AppOptions{Mesh: mesh},
				After: func(t *testing.T, tp *ctzonetest.Topology, _ ctzonetest.Result) {
					st := logConntrack(t, tp)
					app, other := st.Zone(DefaultZone, "udp"), st.Zone(0, "udp")
					if app.Entries == 0 || app.NATed != app.Entries {
						t.Errorf("zone %d: %+v, want captured (NATed) port-53 entries only", DefaultZone, app)
					}
					if other.Entries == 0 || other.NATed != 0 {
						t.Errorf("zone 0: %+v, want the proxy's upstream entries, none NATed", other)
					}
				},
			})
			if r.Mesh != mesh || r.Misrouted != 0 || r.MeshOK != mesh || r.UpstreamMesh != 0 {
				t.Errorf("want all %d mesh queries answered by the proxy: %s", mesh, r)
			}
			if r.ExternalOK != r.External {
				t.Errorf("external queries failed: %s", r)
			}
			if len(r.FirstProblems) > 0 {
				t.Errorf("problems: %s", strings.Join(r.FirstProblems, "\n"))
			}
			// The zero above means something only if the tuples did collide.
			if r.SharedPorts < 2 {
				t.Errorf("the app and the proxy's upstream queries shared %d source ports: the workload did not force collisions: %s", r.SharedPorts, r)
			}
		})
	}
}

func logConntrack(t *testing.T, tp *ctzonetest.Topology) *ConntrackStatus {
	t.Helper()
	var st *ConntrackStatus
	if err := tp.Pod.Do(func() (err error) { st, err = ReadConntrackStatus(); return err }); err != nil {
		t.Fatalf("ReadConntrackStatus: %v", err)
	}
	var b strings.Builder
	if err := st.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	t.Logf("conntrack in the pod namespace:\n%s", b.String())
	return st
}
