package ctzone

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// TestCaptureCoverage checks what iptables mode captures and where it sends it,
// with capture-all, a node-local (non-loopback) listen address and v4 and v6
// nameservers: UDP and TCP, from local processes (nat OUTPUT) and from a pod
// namespace (nat PREROUTING), each nameserver to its slot port, other
// destinations to the capture-all slot, proxy UIDs untouched. Every answer must
// come back from the address the client asked (dig rejects anything else), and
// no port-53 conntrack entry may be left UNREPLIED (zones symmetric).
func TestCaptureCoverage(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "dig", "setpriv")
	node := testenv.NewNetns(t, "mdct-cnode")
	pod := testenv.NewNetns(t, "mdct-cpod")
	testenv.Veth(t, node, "veth-pod", "169.254.98.1/30", pod, "eth0", "169.254.98.2/30")
	node.IP(t, "-6", "addr", "add", "fd00:98::1/64", "dev", "veth-pod", "nodad")
	pod.IP(t, "-6", "addr", "add", "fd00:98::2/64", "dev", "eth0", "nodad")
	pod.IP(t, "route", "add", "default", "via", "169.254.98.1")
	pod.IP(t, "-6", "route", "add", "default", "via", "fd00:98::1")
	for _, a := range []string{"169.254.53.1/32", "169.254.54.1/32", "169.254.20.53/32"} {
		node.IP(t, "addr", "add", a, "dev", "lo")
	}
	for _, a := range []string{"fd00:53::1/128", "fd00:54::1/128", "fd00:20::53/128"} {
		node.IP(t, "-6", "addr", "add", a, "dev", "lo", "nodad")
	}
	// Real nameservers and the resolver's slots, each with its own answer.
	for addr, answer := range map[string]string{
		"169.254.53.1:53":  "192.0.2.1",    // nameserver 0
		"[fd00:53::1]:53":  "192.0.2.2",    // nameserver 1
		"169.254.54.1:53":  "192.0.2.3",    // some other server (capture-all)
		"[fd00:54::1]:53":  "192.0.2.4",    // some other v6 server (capture-all)
		"169.254.20.53:53": "198.51.100.0", // resolver slot 0
		"[fd00:20::53]:54": "198.51.100.1", // resolver slot 1 (v6)
		"169.254.20.53:55": "198.51.100.2", // resolver capture-all slot, v4
		"[fd00:20::53]:55": "198.51.100.3", // resolver capture-all slot, v6
	} {
		testenv.StartFakeDNS(t, node, addr, map[string][]netip.Addr{"probe.test.": {netip.MustParseAddr(answer)}})
	}
	r := mustInstall(t, node, Config{
		ListenAddr:  netip.MustParseAddrPort("169.254.20.53:53"),
		ListenAddr6: netip.MustParseAddrPort("[fd00:20::53]:53"),
		Nameservers: []netip.Addr{netip.MustParseAddr("169.254.53.1"), netip.MustParseAddr("fd00:53::1")},
		CaptureAll:  true,
		ProxyUIDs:   []uint32{1337},
	})
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})

	for _, tc := range []struct {
		name   string
		ns     *testenv.Netns
		uid    int
		server string
		want   string
	}{
		{"host app to nameserver 0", node, 1000, "169.254.53.1", "198.51.100.0"},
		{"host app to nameserver 1 (v6)", node, 1000, "fd00:53::1", "198.51.100.1"},
		{"host app to other server", node, 1000, "169.254.54.1", "198.51.100.2"},
		{"host app to other v6 server", node, 1000, "fd00:54::1", "198.51.100.3"},
		{"host app to the resolver", node, 1000, "169.254.20.53", "198.51.100.0"},
		{"host root to nameserver 0", node, 0, "169.254.53.1", "198.51.100.0"},
		{"proxy uid to nameserver 0", node, 1337, "169.254.53.1", "192.0.2.1"},
		{"proxy uid to nameserver 1 (v6)", node, 1337, "fd00:53::1", "192.0.2.2"},
		{"pod to nameserver 0", pod, 1000, "169.254.53.1", "198.51.100.0"},
		{"pod to nameserver 1 (v6)", pod, 1000, "fd00:53::1", "198.51.100.1"},
		{"pod to other server", pod, 1000, "169.254.54.1", "198.51.100.2"},
		{"pod to other v6 server", pod, 1000, "fd00:54::1", "198.51.100.3"},
		{"pod to the resolver", pod, 1000, "169.254.20.53", "198.51.100.0"},
	} {
		for _, proto := range []string{"udp", "tcp"} {
			t.Run(tc.name+"/"+proto, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				args := []string{"+short", "+time=2", "+tries=1", "@" + tc.server, "probe.test", "A"}
				if proto == "tcp" {
					args = append([]string{"+tcp"}, args...)
				}
				out, err := testenv.Command(ctx, testenv.Proc{Netns: tc.ns, UID: tc.uid, GID: tc.uid}, "dig", args...).CombinedOutput()
				if got := strings.TrimSpace(string(out)); err != nil || got != tc.want {
					t.Errorf("dig %s: got %q (err %v), want %s", strings.Join(args, " "), got, err, tc.want)
				}
			})
		}
	}

	var st *ConntrackStatus
	if err := node.Do(func() (err error) { st, err = ReadConntrackStatus(); return err }); err != nil {
		t.Fatalf("ReadConntrackStatus: %v", err)
	}
	var b strings.Builder
	_ = st.WriteTable(&b)
	t.Logf("conntrack in the node namespace:\n%s", b.String())
	if z := st.Zone(r.Zone(), "udp"); z.NATed == 0 {
		t.Errorf("no captured UDP entries in zone %d: %+v", r.Zone(), z)
	}
	for _, z := range st.Zones {
		if z.Unreplied != 0 {
			t.Errorf("zone %d %s: %d UNREPLIED port-53 entries: request and reply took different zones", z.Zone, z.Proto, z.Unreplied)
		}
	}
}
