package meshdata

import (
	"strings"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

func TestNewTable(t *testing.T) {
	for _, tc := range []struct {
		n, gen     int
		namespaces int
		last       string
		lastIP     string
	}{
		{n: 1000, gen: 0, namespaces: 10, last: "svc-99.ns-9.svc.cluster.local.", lastIP: "240.0.3.232"},
		{n: 150, gen: 1, namespaces: 2, last: "svc-49.ns-1.svc.cluster.local.", lastIP: "241.0.0.150"},
		{n: 100000, gen: 0, namespaces: 1000, last: "svc-99.ns-999.svc.cluster.local.", lastIP: "240.1.134.160"},
	} {
		tab := NewTable(tc.n, tc.gen)
		if len(tab.Services) != tc.n {
			t.Fatalf("n=%d: %d services", tc.n, len(tab.Services))
		}
		if got := len(tab.Namespaces()); got != tc.namespaces {
			t.Errorf("n=%d: %d namespaces, want %d", tc.n, got, tc.namespaces)
		}
		last := tab.Services[tc.n-1]
		if last.FQDN() != tc.last || last.IP.String() != tc.lastIP {
			t.Errorf("n=%d gen=%d: last = %s %s, want %s %s", tc.n, tc.gen, last.FQDN(), last.IP, tc.last, tc.lastIP)
		}
		names, ips := map[string]bool{}, map[string]bool{}
		for _, s := range tab.Services {
			if names[s.FQDN()] || ips[s.IP.String()] {
				t.Fatalf("n=%d: duplicate %s / %s", tc.n, s.FQDN(), s.IP)
			}
			names[s.FQDN()], ips[s.IP.String()] = true, true
			if _, ok := dns.IsDomainName(s.FQDN()); !ok || !dns.IsSubDomain(Zone, s.FQDN()) {
				t.Fatalf("bad name %q", s.FQDN())
			}
		}
	}
}

func TestGenerationsDiffer(t *testing.T) {
	for i := range []int{0, 999, 99999} {
		if ServiceIP(i, 0) == ServiceIP(i, 1) || ServiceIP(i, 1) == ServiceIP(i, 2) {
			t.Errorf("service %d: generations share an address", i)
		}
	}
}

// A partial rewrite changes every 100th name and the last, and nothing
// else.
func TestPartialTable(t *testing.T) {
	base, part := NewTable(1000, 0), PartialTable(1000, 0, 3, 100)
	changed := 0
	for i, s := range part.Services {
		want := base.Services[i].IP
		if i%100 == 0 || i == 999 {
			want = ServiceIP(i, 3)
			changed++
		}
		if s.IP != want || s.FQDN() != base.Services[i].FQDN() {
			t.Fatalf("service %d: %s %s, want %s %s", i, s.FQDN(), s.IP, base.Services[i].FQDN(), want)
		}
	}
	if changed != 11 {
		t.Errorf("%d changed, want 11", changed)
	}
}

func TestNdotsLookup(t *testing.T) {
	got := NdotsLookup("svc-1.ns-2.svc.cluster.local", "ns-3")
	want := []Query{
		{"svc-1.ns-2.svc.cluster.local.ns-3.svc.cluster.local.", "A"},
		{"svc-1.ns-2.svc.cluster.local.ns-3.svc.cluster.local.", "AAAA"},
		{"svc-1.ns-2.svc.cluster.local.svc.cluster.local.", "A"},
		{"svc-1.ns-2.svc.cluster.local.svc.cluster.local.", "AAAA"},
		{"svc-1.ns-2.svc.cluster.local.cluster.local.", "A"},
		{"svc-1.ns-2.svc.cluster.local.cluster.local.", "AAAA"},
		{"svc-1.ns-2.svc.cluster.local.", "A"},
		{"svc-1.ns-2.svc.cluster.local.", "AAAA"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d queries, want %d: %v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("query %d = %v, want %v", i, got[i], want[i])
		}
	}
}

func TestQueryFiles(t *testing.T) {
	tab := NewTable(1000, 0)
	for _, tc := range []struct {
		name  string
		qs    []Query
		lines int
		// every line must satisfy ok
		ok func(name, typ string) bool
	}{
		{"table", tab.InTableQueries(1), 1000, func(n, ty string) bool {
			return ty == "A" && strings.HasSuffix(n, ".svc.cluster.local") && strings.Count(n, ".") == 4
		}},
		{"fwd", ForwardQueries(1000, 2), 1000, func(n, ty string) bool {
			return ty == "A" && strings.HasSuffix(n, ".example.com")
		}},
		{"ndots", tab.NdotsQueries(1000, 3), 8000, func(n, ty string) bool {
			return (ty == "A" || ty == "AAAA") && (strings.HasSuffix(n, "cluster.local") || strings.HasSuffix(n, "example.com"))
		}},
	} {
		file := QueryFile(tc.qs)
		lines := strings.Split(strings.TrimSuffix(file, "\n"), "\n")
		if len(lines) != tc.lines {
			t.Errorf("%s: %d lines, want %d", tc.name, len(lines), tc.lines)
		}
		for _, l := range lines {
			f := strings.Fields(l)
			if len(f) != 2 || strings.HasSuffix(f[0], ".") || !tc.ok(f[0], f[1]) {
				t.Fatalf("%s: bad line %q", tc.name, l)
			}
		}
	}
	// Deterministic for a seed, different across seeds.
	if QueryFile(tab.InTableQueries(1)) != QueryFile(tab.InTableQueries(1)) {
		t.Error("same seed gave different files")
	}
	if QueryFile(tab.InTableQueries(1)) == QueryFile(tab.InTableQueries(2)) {
		t.Error("different seeds gave the same order")
	}
	// ndots: 75% of the queries are search-expanded (must be NXDOMAIN or autopath).
	expanded := 0
	for _, q := range tab.NdotsQueries(1000, 3) {
		if strings.Count(q.Name, "cluster.local") == 2 || strings.HasSuffix(q.Name, ".example.com.cluster.local.") ||
			strings.HasSuffix(q.Name, ".example.com.svc.cluster.local.") || strings.Contains(q.Name, ".example.com.ns-") {
			expanded++
		}
	}
	if expanded != 6000 {
		t.Errorf("ndots: %d search-expanded queries, want 6000", expanded)
	}
}

// The JSON table must load with the resolver's own parser, with every name and
// address intact.
func TestNameTableJSONLoadsInResolver(t *testing.T) {
	tab := NewTable(250, 1)
	data, err := tab.NameTableJSON()
	if err != nil {
		t.Fatal(err)
	}
	f, err := nametable.Parse(data)
	if err != nil {
		t.Fatalf("nametable.Parse: %v", err)
	}
	if len(f.Table) != 250 {
		t.Fatalf("%d hosts, want 250", len(f.Table))
	}
	for _, s := range tab.Services {
		h, ok := f.Table[strings.TrimSuffix(s.FQDN(), ".")]
		if !ok || len(h.IPs) != 1 || h.IPs[0] != s.IP.String() || h.Registry != nametable.RegistryKubernetes ||
			h.Shortname != s.Name || h.Namespace != s.Namespace {
			t.Fatalf("%s: got %+v", s.FQDN(), h)
		}
	}
}

func TestRenderedConfigs(t *testing.T) {
	tab := NewTable(3, 0)
	hosts := tab.Hosts()
	if want := "240.0.0.1 svc-0.ns-0.svc.cluster.local\n240.0.0.2 svc-1.ns-0.svc.cluster.local\n240.0.0.3 svc-2.ns-0.svc.cluster.local\n"; hosts != want {
		t.Errorf("hosts:\n%s\nwant:\n%s", hosts, want)
	}
	// The SOA must parse as one RR in the mesh zone with the mesh TTL.
	rr, err := dns.NewRR(SOA())
	if err != nil {
		t.Fatalf("SOA %q: %v", SOA(), err)
	}
	if soa, ok := rr.(*dns.SOA); !ok || soa.Hdr.Name != Zone || soa.Minttl != MeshTTL {
		t.Errorf("SOA = %v", rr)
	}
	// Zone file parses: SOA, NS, glue.
	zp := dns.NewZoneParser(strings.NewReader(ZoneFile()), "", "")
	var types []uint16
	for rr, ok := zp.Next(); ok; rr, ok = zp.Next() {
		types = append(types, rr.Header().Rrtype)
	}
	if zp.Err() != nil || len(types) != 3 || types[0] != dns.TypeSOA {
		t.Errorf("zone file: types %v, err %v", types, zp.Err())
	}
	for _, tc := range []struct {
		name, text string
		want       []string
	}{
		{"unbound", tab.UnboundConf(5305, "/tmp/x", "127.0.0.1", 5300), []string{
			"interface: 127.0.0.1@5305", "num-threads: 1", `local-zone: "cluster.local." static`,
			`local-data: "svc-2.ns-0.svc.cluster.local. 30 IN A 240.0.0.3"`, "forward-addr: 127.0.0.1@5300",
			`local-data: "cluster.local. 30 IN SOA`,
		}},
		{"coredns-hosts", CorefileHosts(5303, "/d/h", "/d/z", "127.0.0.1:5300"), []string{
			"cluster.local:5303 {", "hosts /d/h cluster.local {", "fallthrough", "file /d/z cluster.local", ".:5303 {", "forward . 127.0.0.1:5300",
		}},
		{"coredns-prod", CorefileProd(5302, ProdPorts{1, 2, 3}, "/d/h", "/d/z", "127.0.0.1:5300"), []string{
			"errors", "health 127.0.0.1:1", "ready 127.0.0.1:2", "prometheus 127.0.0.1:3", "cache 30", "loop", "reload",
			"max_concurrent 1000", "hosts /d/h cluster.local {",
		}},
		{"dnsmasq", strings.Join(DnsmasqArgs(5306, "/d/h", "127.0.0.1#5300"), " "), []string{
			"--port=5306", "--addn-hosts=/d/h", "--local=/cluster.local/", "--server=127.0.0.1#5300", "--no-resolv", "--local-ttl=30",
		}},
	} {
		for _, w := range tc.want {
			if !strings.Contains(tc.text, w) {
				t.Errorf("%s: missing %q in:\n%s", tc.name, w, tc.text)
			}
		}
	}
}

func TestExternalIP(t *testing.T) {
	a, b := ExternalIP("e-1.example.com."), ExternalIP("E-1.Example.COM")
	if a != b {
		t.Errorf("case/trailing dot changed the answer: %s vs %s", a, b)
	}
	if ExternalIP("e-2.example.com.") == a {
		t.Error("different names share an answer")
	}
	if !strings.HasPrefix(a.String(), "198.1") {
		t.Errorf("%s not in 198.18.0.0/15", a)
	}
}
