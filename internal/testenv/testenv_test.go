package testenv

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFixtures proves the fixtures themselves: a process started through Command
// really runs in the test's cgroup, netns and UID, sees the namespace's resolv.conf,
// reaches a FakeDNS across a veth pair, and everything is gone after cleanup.
func TestFixtures(t *testing.T) {
	RequirePrivileged(t, "ip", "setpriv", "dig")
	var cgPath, nsName string
	t.Run("scoped", func(t *testing.T) {
		cg := NewCgroup(t)
		node := NewNetns(t, "mdt-node")
		pod := NewNetns(t, "mdt-pod")
		cgPath, nsName = cg.Path, node.Name
		Veth(t, node, "veth-pod", "169.254.99.1/30", pod, "eth0", "169.254.99.2/30")
		node.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
		pod.IP(t, "route", "add", "default", "via", "169.254.99.1")
		pod.SetResolvConf(t, "nameserver 169.254.53.1\n")
		fake := StartFakeDNS(t, node, "169.254.53.1:53", map[string][]netip.Addr{
			"known.test.": {netip.MustParseAddr("169.254.7.7")},
		})

		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		p := Proc{Netns: pod, Cgroup: cg, UID: 1000, GID: 1000}
		out, err := Command(ctx, p, "sh", "-c", "id -u; cat /proc/self/cgroup | grep '^0::'; cat /etc/resolv.conf; dig +short +time=2 +tries=1 known.test").CombinedOutput()
		if err != nil {
			t.Fatalf("client: %v\n%s", err, out)
		}
		got := string(out)
		for _, want := range []string{"1000\n", "0::/" + filepath.Base(cg.Path), "nameserver 169.254.53.1", "169.254.7.7"} {
			if !strings.Contains(got, want) {
				t.Errorf("client output lacks %q:\n%s", want, got)
			}
		}
		if n := fake.Count("known.test."); n != 1 {
			t.Errorf("fake DNS saw %d queries for known.test, want 1", n)
		}
		if q := fake.Queries(); len(q) > 0 && q[0].Source.Addr() != netip.MustParseAddr("169.254.99.2") {
			t.Errorf("query came from %v, want the pod address", q[0].Source)
		}
	})
	if _, err := os.Stat(cgPath); !os.IsNotExist(err) {
		t.Errorf("cgroup %s left behind (stat: %v)", cgPath, err)
	}
	if _, err := os.Stat(filepath.Join("/var/run/netns", nsName)); !os.IsNotExist(err) {
		t.Errorf("netns %s left behind (stat: %v)", nsName, err)
	}
}
