package nametable

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/miekg/dns"
)

func mustBuild(t *testing.T, f *File) *Table {
	t.Helper()
	tb, err := Build(f, Options{})
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	return tb
}

func TestParseErrors(t *testing.T) {
	tests := []struct {
		name, data, want string
	}{
		{"json syntax", "{\n \"table\": {\n  \"a.b\": {\"ips\": [\"1.2.3.4\",]}\n}}", "line 3"},
		{"json type", "{\n\"table\": {\"a.b\": {\"ips\": \"1.2.3.4\"}}}", "table.ips"},
		{"json unknown field", `{"table": {"a.b": {"ipz": []}}}`, `unknown field "ipz"`},
		{"yaml syntax", "table:\n  a.b:\n    ips: [1.2.3.4\n  c: d\n", "line"},
		{"yaml unknown field", "table:\n  a.b:\n    ipz: [1.2.3.4]\n", `unknown field "ipz"`},
		{"yaml type", "table:\n  a.b:\n    ports: 5\n", "ports"},
		{"data after the object", "{\"table\": {}}\n{}", "line 2: unexpected data"},
		{"a bracket after the object", `{"table": {}} ]`, "unexpected data"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.data))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Parse error = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestBuildErrors(t *testing.T) {
	tests := []struct {
		name string
		f    File
		want string
	}{
		{"bad ip", File{Table: map[string]HostInfo{"a.example.com": {IPs: []string{"10.0.0.1", "10.0.0"}}}}, `table["a.example.com"].ips[1]: "10.0.0" is not an IP address`},
		{"bad name", File{Table: map[string]HostInfo{"a..b": {IPs: []string{"10.0.0.1"}}}}, `table["a..b"]`},
		{"mid wildcard", File{Table: map[string]HostInfo{"a.*.com": {IPs: []string{"10.0.0.1"}}}}, "'*' is only allowed"},
		{"bad port", File{Table: map[string]HostInfo{"a.b.c": {IPs: []string{"10.0.0.1"}, Ports: []Port{{Name: "http", Port: 70000}}}}}, `table["a.b.c"].ports[0]: port: 70000`},
		{"bad proto", File{Table: map[string]HostInfo{"a.b.c": {IPs: []string{"10.0.0.1"}, Ports: []Port{{Name: "http", Port: 80, Protocol: "quic"}}}}}, `protocol: "quic"`},
		{"bad registry case", File{Table: map[string]HostInfo{"a.b.c": {IPs: []string{"10.0.0.1"}, Registry: "kubernetes"}}}, "did you mean"},
		{"dup case", File{Table: map[string]HostInfo{"a.b.c": {IPs: []string{"10.0.0.1"}}, "A.b.c": {IPs: []string{"10.0.0.2"}}}}, "same host"},
		{"bad client", File{Clients: map[string]string{"nope": "ns1"}}, `clients["nope"]`},
		{"bad alt", File{Table: map[string]HostInfo{"a.b.c": {IPs: []string{"10.0.0.1"}, AltHosts: []string{"x y"}}}}, `altHosts[0]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Build(&tt.f, Options{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Build error = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func k8s(ips ...string) HostInfo { return HostInfo{IPs: ips, Registry: RegistryKubernetes} }

func TestLookupNames(t *testing.T) {
	f := &File{
		Table: map[string]HostInfo{
			"reviews.ns1.svc.cluster.local":  k8s("10.0.0.1"),
			"reviews.ns2.svc.cluster.local":  k8s("10.0.0.2"),
			"ratings.ns2.svc.cluster.local":  k8s("10.0.0.3", "fd00::3"),
			"*.wild.example.com":             {IPs: []string{"192.0.2.9"}},
			"ext.example.com":                {AltHosts: []string{"ext-alias.example.com"}},
			"headless.ns2.svc.cluster.local": {Registry: RegistryKubernetes}, // no IPs: skipped
		},
		Clients: map[string]string{"10.244.0.5": "ns1", "10.244.0.6": "ns3"},
	}
	tb := mustBuild(t, f)
	none := netip.Addr{}
	tests := []struct {
		name   string
		client netip.Addr
		host   string // "" = not found
		wild   bool
	}{
		{"reviews.ns1.svc.cluster.local.", none, "reviews.ns1.svc.cluster.local.", false},
		{"reviews.ns1.", none, "reviews.ns1.svc.cluster.local.", false},
		{"reviews.ns1.svc.", none, "reviews.ns1.svc.cluster.local.", false},
		{"reviews.", none, "", false}, // two namespaces: ambiguous
		{"ratings.", none, "ratings.ns2.svc.cluster.local.", false},
		{"reviews.", netip.MustParseAddr("10.244.0.5"), "reviews.ns1.svc.cluster.local.", false},
		{"ratings.", netip.MustParseAddr("10.244.0.5"), "", false}, // client's ns has none
		{"reviews.", netip.MustParseAddr("::ffff:10.244.0.5"), "reviews.ns1.svc.cluster.local.", false},
		{"a.wild.example.com.", none, "*.wild.example.com.", true},
		{"x.y.wild.example.com.", none, "*.wild.example.com.", true},
		{"wild.example.com.", none, "", false},
		{"ext.example.com.", none, "ext.example.com.", false},
		{"ext-alias.example.com.", none, "ext.example.com.", false},
		{"headless.ns2.svc.cluster.local.", none, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name+"/"+tt.client.String(), func(t *testing.T) {
			n, wild := tb.Find(tt.name, tt.client)
			got := ""
			if n != nil {
				got = n.Host.Name
			}
			if got != tt.host || wild != tt.wild {
				t.Fatalf("Find(%q) = %q, wild %v; want %q, %v", tt.name, got, wild, tt.host, tt.wild)
			}
		})
	}
	if tb.Len() != 5 {
		t.Errorf("Len = %d, want 5", tb.Len())
	}
	if got := tb.Skipped(); got != 1 {
		t.Errorf("Skipped = %v, want 1 (the headless host without addresses)", got)
	}
	for _, ent := range []string{"cluster.local.", "svc.cluster.local.", "ns2.svc.cluster.local."} {
		if !tb.IsEmptyNonTerminal(ent) {
			t.Errorf("%s is not an empty non-terminal", ent)
		}
	}
	if tb.IsEmptyNonTerminal("ns9.svc.cluster.local.") {
		t.Errorf("ns9 is an empty non-terminal")
	}
	// PTR for v4, v6 and the auto VIP of ext.example.com.
	ext, _ := tb.Find("ext.example.com.", none)
	for _, a := range []netip.Addr{netip.MustParseAddr("10.0.0.3"), netip.MustParseAddr("fd00::3"), ext.Host.V4[0], ext.Host.V6[0]} {
		rev, _ := dns.ReverseAddr(a.String())
		if rev != ReverseName(a) {
			t.Fatalf("ReverseName(%s) = %s, want %s", a, ReverseName(a), rev)
		}
		ptr := tb.PTR(rev)
		if len(ptr) != 1 || (ptr[0] != "ext.example.com." && ptr[0] != "ratings.ns2.svc.cluster.local.") {
			t.Fatalf("PTR %s: %v", rev, ptr)
		}
	}
}

func TestVIPAllocation(t *testing.T) {
	f := &File{Table: map[string]HostInfo{}}
	for i := range 300 {
		f.Table[fmt.Sprintf("svc%d.example.com", i)] = HostInfo{}
	}
	a := mustBuild(t, f)
	b := mustBuild(t, f) // a restart: same input, same VIPs
	seen := map[netip.Addr]string{}
	for i := range 300 {
		name := fmt.Sprintf("svc%d.example.com.", i)
		na, nb := a.Lookup(name), b.Lookup(name)
		if !na.Host.AutoVIP || len(na.Host.V4) != 1 || len(na.Host.V6) != 1 {
			t.Fatalf("%s: no auto VIP: %+v", name, na.Host)
		}
		if na.Host.V4[0] != nb.Host.V4[0] || na.Host.V6[0] != nb.Host.V6[0] {
			t.Fatalf("%s: VIP differs between builds", name)
		}
		v4, v6 := na.Host.V4[0], na.Host.V6[0]
		if !vipPrefix4.Contains(v4) || !vipPrefix6.Contains(v6) {
			t.Fatalf("%s: VIP %s %s outside the ranges", name, v4, v6)
		}
		if v4.As4()[2] != v6.As16()[14] || v4.As4()[3] != v6.As16()[15] {
			t.Fatalf("%s: v4 %s and v6 %s do not pair", name, v4, v6)
		}
		if prev, dup := seen[v4]; dup {
			t.Fatalf("%s and %s share %s", name, prev, v4)
		}
		seen[v4] = name
	}
	// Adding hosts that do not collide leaves every existing VIP alone
	// (a reload with more hosts).
	f.Table["zzz-new.example.com"] = HostInfo{}
	c := mustBuild(t, f)
	moved := 0
	for i := range 300 {
		name := fmt.Sprintf("svc%d.example.com.", i)
		if a.Lookup(name).Host.V4[0] != c.Lookup(name).Host.V4[0] {
			moved++
		}
	}
	if moved > 1 {
		t.Fatalf("%d VIPs moved after adding one host", moved)
	}
	// Collisions probe in (Order, name) order: force two names onto one
	// slot by reserving everything but two slots.
	a2 := newVIPAllocator()
	for s := 1; s <= vipSlots; s++ {
		if s != 7 && s != 9 {
			a2.reserve(&Host{V4: []netip.Addr{vipForSlot(s).v4}}, +1)
		}
	}
	ha, hb := &Host{Name: "a."}, &Host{Name: "b."}
	if err := a2.allocate([]*Host{hb, ha}); err != nil || ha.V4[0] == hb.V4[0] || ha.V4[0] != vipForSlot(7).v4 && ha.V4[0] != vipForSlot(9).v4 {
		t.Fatalf("allocate with two free slots: %v %v %v", ha.V4, hb.V4, err)
	}
	if err := a2.allocate([]*Host{{Name: "c."}}); err == nil {
		t.Fatalf("no error when the pool is exhausted")
	}
	// Explicit addresses in the range are never handed out again.
	slot := vipHome("auto.example.com.")
	f2 := &File{Table: map[string]HostInfo{
		"auto.example.com":   {},
		"pinned.example.com": {IPs: []string{vipForSlot(slot).v4.String()}},
	}}
	tb := mustBuild(t, f2)
	if tb.Lookup("auto.example.com.").Host.V4[0] == vipForSlot(slot).v4 {
		t.Fatalf("auto VIP reuses an explicit address")
	}
}

func TestSRVRecords(t *testing.T) {
	tb := mustBuild(t, &File{Table: map[string]HostInfo{
		"reviews.ns1.svc.cluster.local": {IPs: []string{"10.0.0.1"}, Registry: RegistryKubernetes,
			Ports: []Port{{Name: "http", Port: 9080}, {Name: "dns", Port: 53, Protocol: "UDP"}}},
	}})
	n, _ := tb.Find("reviews.ns1.", netip.Addr{})
	h := n.Host
	if len(h.Ports) != 2 || h.Ports[1].Protocol != "udp" || h.Ports[0].Name != "http" || h.Ports[0].Port != 9080 {
		t.Fatalf("ports: %+v", h.Ports)
	}
	if got := h.SRVTarget(&h.Ports[0]); got != "reviews.ns1.svc.cluster.local." {
		t.Fatalf("SRV target: %v", got)
	}
}
