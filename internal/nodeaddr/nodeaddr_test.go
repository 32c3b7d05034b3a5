//go:build linux

package nodeaddr

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// localAddrs lists the addresses of the current network namespace. It runs
// in Do's goroutine: an error is reported, not fatal.
func localAddrs(t *testing.T) []netip.Addr {
	t.Helper()
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Errorf("list addresses: %v", err)
	}
	var out []netip.Addr
	for _, ia := range ifaddrs {
		if n, ok := ia.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}

func hasLink(name string) bool {
	_, err := net.InterfaceByName(name)
	return err == nil
}

// In a namespace of the test's own: the first agent adds the addresses on a
// dummy link it creates (or on lo where the kernel has no dummy link type); a successor adopts them and, giving up, removes only
// what it added itself; the first agent's Close removes everything it
// recorded, link included; and Remove of those records again is no error.
func TestAddAdoptAbandonRemove(t *testing.T) {
	testenv.RequirePrivileged(t, "ip")
	ns := testenv.NewNetns(t, "nodeaddr")
	log := slog.New(slog.DiscardHandler)
	const link = "meshdns-t0"
	a53, a54, v6 := netip.MustParseAddr("169.254.20.53"), netip.MustParseAddr("169.254.20.54"), netip.MustParseAddr("fd00::53")
	loop := netip.MustParseAddr("127.0.0.1")
	err := ns.Do(func() error {
		first := New([]netip.Addr{a53, v6, loop}, link, nil, log)
		if err := first.Start(t.Context()); err != nil {
			return fmt.Errorf("first Start: %v", err)
		}
		recs := first.Records()
		// On the dummy link it created, or on lo where the kernel has no
		// dummy link type.
		on := "lo"
		want := []agentstate.NodeAddr{{Link: on, Addr: "169.254.20.53/32"}, {Link: on, Addr: "fd00::53/128"}}
		if hasLink(link) {
			on = link
			want = []agentstate.NodeAddr{{Link: on, CreatedLink: true}, {Link: on, Addr: "169.254.20.53/32"}, {Link: on, Addr: "fd00::53/128"}}
		}
		t.Logf("addresses on %s", on)
		if !slices.Equal(recs, want) {
			t.Errorf("first records %+v, want %+v (the loopback address is not added)", recs, want)
		}
		if got := localAddrs(t); !slices.Contains(got, a53) || !slices.Contains(got, v6) {
			return fmt.Errorf("after Start: addresses %v", got)
		}
		created := on == link

		succ := New([]netip.Addr{a53, v6, a54}, link, recs, log)
		if err := succ.Start(t.Context()); err != nil {
			return fmt.Errorf("successor Start: %v", err)
		}
		if got := succ.Records(); len(got) != len(recs)+1 || !slices.Equal(got[:len(recs)], recs) || got[len(recs)].Addr != "169.254.20.54/32" {
			t.Errorf("successor records %+v, want the adopted %+v and 169.254.20.54/32", got, recs)
		}
		if err := succ.Abandon(); err != nil {
			return fmt.Errorf("Abandon: %v", err)
		}
		got := localAddrs(t)
		if slices.Contains(got, a54) {
			t.Errorf("169.254.20.54, the successor's own, still present after Abandon: %v", got)
		}
		if !slices.Contains(got, a53) || !slices.Contains(got, v6) || hasLink(link) != created {
			t.Errorf("Abandon removed adopted addresses or the link: %v, link present: %v", got, hasLink(link))
		}

		if err := first.Close(); err != nil {
			return fmt.Errorf("first Close: %v", err)
		}
		if got := localAddrs(t); slices.Contains(got, a53) || slices.Contains(got, v6) || hasLink(link) {
			t.Errorf("after Close: addresses %v, link present: %v", got, hasLink(link))
		}
		if err := Remove(recs, log); err != nil {
			t.Errorf("Remove of records already removed: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err) // after Do: on the test's goroutine
	}
}

// Handoff leaves the addresses to a successor: Close removes nothing.
func TestHandoffKeepsAddresses(t *testing.T) {
	testenv.RequirePrivileged(t, "ip")
	ns := testenv.NewNetns(t, "nodeaddr")
	log := slog.New(slog.DiscardHandler)
	a := netip.MustParseAddr("169.254.20.53")
	err := ns.Do(func() error {
		s := New([]netip.Addr{a}, "meshdns-t1", nil, log)
		if err := s.Start(t.Context()); err != nil {
			return fmt.Errorf("Start: %v", err)
		}
		s.Handoff()
		if err := s.Close(); err != nil {
			return fmt.Errorf("Close: %v", err)
		}
		if !slices.Contains(localAddrs(t), a) {
			t.Errorf("Close after Handoff removed %s", a)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err) // after Do: on the test's goroutine
	}
}
