package ctzone

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestWriteTable(t *testing.T) {
	st := &ConntrackStatus{
		Zones: []ZoneEntries{{Zone: 0, Proto: "udp", Entries: 8}, {Zone: 16211, Proto: "udp", Entries: 12, NATed: 12, Unreplied: 1}},
		Stats: []CPUStat{{CPU: 0, InsertFailed: 3, Drop: 1}, {CPU: 1, InsertFailed: 4}},
		Total: CPUStat{CPU: -1, InsertFailed: 7, Drop: 1}, Entries: 20, MaxEntries: 262144,
	}
	var b strings.Builder
	if err := st.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	want := `ZONE   PROTO  PORT53_ENTRIES  NATED  UNREPLIED
0      udp    8               0      0
16211  udp    12              12     1

CPU    FOUND  INVALID  IGNORE  INSERT  INSERT_FAILED  DROP  EARLY_DROP  ERROR  SEARCH_RESTART
0      0      0        0       0       3              1     0           0      0
1      0      0        0       0       4              0     0           0      0
total  0      0        0       0       7              1     0           0      0

CONNTRACK_ENTRIES  CONNTRACK_MAX
20                 262144
`
	if b.String() != want {
		t.Errorf("WriteTable:\n%s\nwant:\n%s", b.String(), want)
	}
}

// TestSlots: nameserver i goes to listen port + i, capture-all to + N, per
// family, and the zone rules cover exactly those ports.
func TestSlots(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cfg      Config
		want4    []string // "addr->port"
		want6    []string
		all4     uint16
		range4   [2]uint16
		warnings int
	}{
		{
			name:   "loopback listen, v4 and v6",
			cfg:    Config{ListenAddr: netip.MustParseAddrPort("127.0.0.1:15053"), Nameservers: addrs("10.96.0.10", "fd00::10", "10.96.0.11")},
			want4:  []string{"10.96.0.10->15053", "10.96.0.11->15055"},
			want6:  []string{"fd00::10->15054"},
			range4: [2]uint16{15053, 15055},
		},
		{
			name:   "capture-all",
			cfg:    Config{ListenAddr: netip.MustParseAddrPort("169.254.20.53:53"), Nameservers: addrs("10.96.0.10"), CaptureAll: true},
			want4:  []string{"10.96.0.10->53"},
			all4:   54,
			range4: [2]uint16{53, 54}, warnings: 1, // no v6 listen address
		},
		{
			name:  "v6-only listen address",
			cfg:   Config{ListenAddr6: netip.MustParseAddrPort("[::1]:15053"), Nameservers: addrs("fd00::10", "10.96.0.10")},
			want4: []string{"10.96.0.10->15054"}, want6: []string{"fd00::10->15053"},
			range4: [2]uint16{15053, 15054},
		},
		{
			name:   "loopback nameserver",
			cfg:    Config{ListenAddr: netip.MustParseAddrPort("127.0.0.1:15053"), Nameservers: addrs("127.0.0.53", "10.0.0.1")},
			want4:  []string{"10.0.0.1->15054"},
			range4: [2]uint16{15053, 15054}, warnings: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := normalize(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			got := func(f family) []string {
				var out []string
				for _, s := range f.servers {
					out = append(out, s.addr.String()+"->"+itoa(s.port))
				}
				return out
			}
			if g := got(n.fams[0]); !slices.Equal(g, tc.want4) {
				t.Errorf("v4 slots %v, want %v", g, tc.want4)
			}
			if g := got(n.fams[1]); !slices.Equal(g, tc.want6) {
				t.Errorf("v6 slots %v, want %v", g, tc.want6)
			}
			if n.fams[0].allPort != tc.all4 {
				t.Errorf("capture-all port %d, want %d", n.fams[0].allPort, tc.all4)
			}
			if r := [2]uint16{n.fams[0].minPort, n.fams[0].maxPort}; r != tc.range4 {
				t.Errorf("v4 slot range %v, want %v", r, tc.range4)
			}
			if len(n.warnings) != tc.warnings {
				t.Errorf("warnings %q, want %d", n.warnings, tc.warnings)
			}
		})
	}
}

func addrs(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

func itoa(p uint16) string { return strconv.Itoa(int(p)) }

// A nameserver listed twice is an error naming it, as in eBPF mode (the
// shared capture plan, internal/captureplan): it is not silently dropped.
func TestDuplicateNameserverIsAnError(t *testing.T) {
	for _, cfg := range []Config{
		{ListenAddr: netip.MustParseAddrPort("127.0.0.1:15053"), Nameservers: addrs("10.0.0.1", "127.0.0.53", "10.0.0.1")},
		{ListenAddr: netip.MustParseAddrPort("169.254.20.53:53"), ListenAddr6: netip.MustParseAddrPort("[fd00::53]:53"), Nameservers: addrs("fd00::10", "::ffff:10.0.0.1", "10.0.0.1"), CaptureAll: true},
	} {
		_, err := New(cfg)
		if err == nil || !strings.Contains(err.Error(), "nameserver 10.0.0.1 is listed twice") {
			t.Errorf("New(%v): %v, want an error naming the duplicate 10.0.0.1", cfg.Nameservers, err)
		}
	}
}
