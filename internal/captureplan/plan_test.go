package captureplan

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

func TestNewValidatesNameservers(t *testing.T) {
	for _, tc := range []struct {
		name       string
		ns         []netip.Addr
		captureAll bool
		want       []netip.Addr
		wantErr    string
	}{
		{name: "in order", ns: addrs("10.0.0.10", "fd00::10"), want: addrs("10.0.0.10", "fd00::10")},
		{name: "v4-mapped is v4, zone dropped", ns: addrs("::ffff:10.0.0.10", "fe80::1%eth0"), want: addrs("10.0.0.10", "fe80::1")},
		{name: "capture-all alone", captureAll: true},
		{name: "nothing", wantErr: "nothing to capture"},
		{name: "duplicate", ns: addrs("10.0.0.10", "10.0.0.11", "10.0.0.10"), wantErr: "nameserver 10.0.0.10 is listed twice (positions 1 and 3)"},
		{name: "duplicate as v4-mapped", ns: addrs("10.0.0.10", "::ffff:10.0.0.10"), wantErr: "nameserver 10.0.0.10 is listed twice"},
		{name: "duplicate with capture-all", ns: addrs("fd00::10", "fd00::10"), captureAll: true, wantErr: "nameserver fd00::10 is listed twice"},
		{name: "unspecified", ns: addrs("0.0.0.0"), wantErr: "not a usable address"},
		{name: "invalid", ns: []netip.Addr{{}}, wantErr: "not a usable address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := New(tc.ns, tc.captureAll)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("New: %v, want an error containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := p.Nameservers(); !slices.Equal(got, tc.want) {
				t.Errorf("nameservers %v, want %v", got, tc.want)
			}
		})
	}
	if _, err := New(nil, false); !errors.Is(err, ErrNothing) {
		t.Errorf("New(nil, false): %v, want ErrNothing", err)
	}
}

func TestSlots(t *testing.T) {
	two, _ := New(addrs("10.0.0.10", "10.0.0.11"), false)
	all, _ := New(addrs("10.0.0.10", "10.0.0.11"), true)
	onlyAll, _ := New(nil, true)
	for _, tc := range []struct {
		name              string
		p                 Plan
		slots, allSlot    int
		allSlots          int
		ports             []uint16
		overflowAt        uint16
		overflowAtAllowed uint16
	}{
		{"two nameservers", two, 2, 2, 0, []uint16{53, 54}, 65535, 65534},
		{"with capture-all", all, 6, 2, CaptureAllSlots, []uint16{53, 54, 55, 56, 57, 58}, 65531, 65530},
		{"capture-all alone", onlyAll, 4, 0, CaptureAllSlots, []uint16{53, 54, 55, 56}, 65533, 65532},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.p.Slots() != tc.slots || tc.p.AllSlot() != tc.allSlot || tc.p.AllSlots() != tc.allSlots {
				t.Errorf("slots %d, first capture-all slot %d, capture-all slots %d; want %d %d %d",
					tc.p.Slots(), tc.p.AllSlot(), tc.p.AllSlots(), tc.slots, tc.allSlot, tc.allSlots)
			}
			if got := tc.p.Ports(53); !slices.Equal(got, tc.ports) {
				t.Errorf("ports %v, want %v", got, tc.ports)
			}
			if err := tc.p.CheckPorts(tc.overflowAt); err == nil || !strings.Contains(err.Error(), "past 65535") {
				t.Errorf("CheckPorts(%d): %v, want past 65535", tc.overflowAt, err)
			}
			if err := tc.p.CheckPorts(tc.overflowAtAllowed); err != nil {
				t.Errorf("CheckPorts(%d): %v", tc.overflowAtAllowed, err)
			}
			if got := len(tc.p.Ports(65535)); got != 1 {
				t.Errorf("Ports(65535) has %d ports, want 1 (cut at 65535)", got)
			}
		})
	}
}

func TestOwns(t *testing.T) {
	p, _ := New(addrs("10.0.0.10", "10.0.0.11"), true) // 6 slots
	listen := []netip.AddrPort{netip.MustParseAddrPort("169.254.20.53:53"), netip.MustParseAddrPort("[fd00::53]:53")}
	for _, tc := range []struct {
		dst  string
		want bool
	}{
		{"169.254.20.53:53", true},
		{"169.254.20.53:58", true},
		{"169.254.20.53:59", false}, // past the slots: someone else's server
		{"169.254.20.53:52", false},
		{"[fd00::53]:55", true},
		{"10.0.0.10:53", false},
	} {
		if got := p.Owns(listen, netip.MustParseAddrPort(tc.dst)); got != tc.want {
			t.Errorf("Owns(%s) = %v, want %v", tc.dst, got, tc.want)
		}
	}
}
