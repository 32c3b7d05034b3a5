package testenv

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// TestInternetAndFreshNames proves the egress fixtures: a name set with SetFresh
// answers a new address of its prefix on every query, with its TTL, and every
// address of the internet's prefix accepts TCP and echoes UDP across a veth pair.
func TestInternetAndFreshNames(t *testing.T) {
	RequirePrivileged(t, "ip", "dig")
	node := NewNetns(t, "mdt-node")
	world := NewNetns(t, "mdt-inet")
	Veth(t, node, "veth-inet", "169.254.98.1/30", world, "eth0", "169.254.98.2/30")
	node.IP(t, "route", "add", "198.18.0.0/15", "via", "169.254.98.2")
	world.IP(t, "route", "add", "default", "via", "169.254.98.1")
	node.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	inet := StartInternet(t, world, netip.MustParsePrefix("198.18.0.0/15"), 8080)
	fake := StartFakeDNS(t, node, "169.254.53.1:53", nil)
	fake.SetFresh("fresh.test", netip.MustParsePrefix("198.18.0.0/16"), 1)

	seen := map[string]bool{}
	for range 3 {
		out := node.Exec(t, "dig", "+noall", "+answer", "+time=2", "+tries=1", "@169.254.53.1", "fresh.test", "A")
		f := strings.Fields(out)
		if len(f) != 5 || f[1] != "1" {
			t.Fatalf("answer %q: want one A record with TTL 1", out)
		}
		a := netip.MustParseAddr(f[4])
		if !netip.MustParsePrefix("198.18.0.0/16").Contains(a) || seen[f[4]] {
			t.Fatalf("answer %s: want a new address of 198.18.0.0/16 (seen %v)", a, seen)
		}
		seen[f[4]] = true
	}

	err := node.Do(func() error {
		c, err := net.DialTimeout("tcp4", "198.19.200.7:8080", 3*time.Second)
		if err != nil {
			return err
		}
		c.Close()
		u, err := net.DialTimeout("udp4", "198.18.3.4:8080", 3*time.Second)
		if err != nil {
			return err
		}
		defer u.Close()
		u.SetDeadline(time.Now().Add(3 * time.Second)) //nolint:errcheck // a UDP socket takes a deadline
		if _, err := u.Write([]byte("ping")); err != nil {
			return err
		}
		buf := make([]byte, 8)
		n, err := u.Read(buf)
		if err == nil && string(buf[:n]) != "ping" {
			err = fmt.Errorf("echo %q", buf[:n])
		}
		return err
	})
	if err != nil {
		t.Fatalf("connect through the internet: %v", err)
	}
	if !WaitFor(3*time.Second, func() bool { return inet.Accepted() == 1 && inet.Echoed() == 1 }) {
		t.Fatalf("internet saw %d connections and %d datagrams, want 1 and 1", inet.Accepted(), inet.Echoed())
	}
}
