package nametable

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func ip(s string) netip.Addr { return netip.MustParseAddr(s) }

func newTestBuilder(t testing.TB, sources ...string) *Builder {
	t.Helper()
	b, err := NewBuilder(Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range sources {
		b.AddSource(s, 100-10*i) // the first source has the highest priority
	}
	return b
}

func publish(t testing.TB, b *Builder) *Table {
	t.Helper()
	tb, err := b.Publish()
	if err != nil {
		t.Fatal(err)
	}
	return tb
}

func set(t testing.TB, b *Builder, src, key string, hosts ...Host) {
	t.Helper()
	if err := b.Set(src, key, hosts); err != nil {
		t.Fatal(err)
	}
}

// dump renders everything a table answers, sorted, so that two tables can
// be compared.
func dump(tb *Table) string {
	var lines []string
	host := func(h *Host) string {
		return fmt.Sprintf("%s src=%s v4=%v v6=%v cname=%s ports=%v vis=%v auto=%v", h.Name, h.Source(), h.V4, h.V6, h.CNAME(), h.Ports, h.Visible(), h.AutoVIP)
	}
	chain := func(e *Name) string {
		var parts []string
		for ; e != nil; e = e.next {
			parts = append(parts, host(e.Host))
		}
		return strings.Join(parts, " | ")
	}
	tb.names.each(func(k string, e *Name) bool { lines = append(lines, "name "+k+" -> "+chain(e)); return true })
	tb.wildcards.each(func(k string, e *Name) bool { lines = append(lines, "wild "+k+" -> "+chain(e)); return true })
	tb.bare.each(func(k string, e *Name) bool { lines = append(lines, "bare "+k+" -> "+chain(e)); return true })
	tb.ptr.each(func(k addrKey, v ptrNames) bool {
		lines = append(lines, fmt.Sprintf("ptr %s -> %v", netip.AddrFrom16(k).Unmap(), v.list()))
		return true
	})
	tb.ents.each(func(k string, _ struct{}) bool { lines = append(lines, "ent "+k); return true })
	for k, v := range tb.clients {
		lines = append(lines, fmt.Sprintf("client %s -> %s", k, v))
	}
	lines = append(lines, fmt.Sprintf("hosts %d skipped %d", tb.hosts, tb.skipped))
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// Applying a random sequence of changes batch by batch gives exactly the
// table that a fresh builder makes from the final state, and never changes
// a table already published.
func TestIncrementalMatchesFresh(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	srcs := []string{"file", "kubernetes", "cluster/b", "serviceentries"}
	b := newTestBuilder(t, srcs...)
	st := newSourcesState(srcs)
	var published []*Table
	var dumps []string
	for batch := range 200 {
		for range 1 + rng.IntN(8) {
			st.change(t, b, rng)
		}
		tb := publish(t, b)
		published = append(published, tb)
		dumps = append(dumps, dump(tb))
		if batch%20 != 19 {
			continue
		}
		got, want := dump(tb), dump(st.fresh(t))
		if !vipInsensitiveEqual(got, want) {
			t.Fatalf("batch %d: incremental table differs from a fresh build:\n--- incremental\n%s\n--- fresh\n%s", batch, got, want)
		}
	}
	for i, tb := range published {
		if d := dump(tb); d != dumps[i] {
			t.Fatalf("table %d changed after it was published", i)
		}
	}
}

// randHost is a random host of a small name space, so that hosts of
// different sources and objects collide.
func randHost(rng *rand.Rand) Host {
	ns := fmt.Sprintf("ns%d", rng.IntN(3))
	svc := fmt.Sprintf("s%d", rng.IntN(6))
	h := Host{Name: svc + "." + ns + ".svc.cluster.local", Kubernetes: true}
	switch rng.IntN(6) {
	case 0: // external
		h = Host{Name: fmt.Sprintf("e%d.example.com", rng.IntN(5)), NeedVIP: rng.IntN(2) == 0, Extra: &HostExtra{}}
		if rng.IntN(3) == 0 {
			h.Extra.Visible = []string{ns}
		}
		if rng.IntN(3) == 0 {
			h.Extra.AltNames = []string{fmt.Sprintf("alt%d.example.com", rng.IntN(3))}
		}
	case 1: // headless endpoint
		h = Host{Name: fmt.Sprintf("db-%d.%s.%s.svc.cluster.local", rng.IntN(2), svc, ns), Merge: true}
	case 2:
		h.Merge = true
	case 3:
		h.Extra = &HostExtra{CNAME: "target.example.org"}
	case 4:
		h = Host{Name: fmt.Sprintf("*.w%d.example.com", rng.IntN(2))}
	}
	if h.CNAME() == "" && !h.NeedVIP {
		for range rng.IntN(3) {
			h.V4 = append(h.V4, netip.AddrFrom4([4]byte{10, 0, byte(rng.IntN(3)), byte(rng.IntN(4))}))
		}
		if rng.IntN(3) == 0 {
			h.V6 = append(h.V6, netip.AddrFrom16([16]byte{0xfd, 15: byte(rng.IntN(4))}))
		}
		if rng.IntN(2) == 0 {
			h.Ports = []HostPort{{Name: "http", Port: uint16(80 + rng.IntN(2))}}
		}
	}
	return h
}

// sourcesState is what the sources of TestIncrementalMatchesFresh hold
// after the changes made so far.
type sourcesState struct {
	srcs    []string
	hosts   map[string]map[string][]Host // source -> key -> hosts
	clients map[string]map[string]clientRec
}

func newSourcesState(srcs []string) *sourcesState {
	st := &sourcesState{srcs: srcs, hosts: map[string]map[string][]Host{}, clients: map[string]map[string]clientRec{}}
	for _, s := range srcs {
		st.hosts[s] = map[string][]Host{}
		st.clients[s] = map[string]clientRec{}
	}
	return st
}

// change makes one random change in b and records it: an object removed,
// a client set or removed, or an object given 1-3 random hosts.
func (st *sourcesState) change(t *testing.T, b *Builder, rng *rand.Rand) {
	t.Helper()
	src := st.srcs[rng.IntN(len(st.srcs))]
	key := fmt.Sprintf("k%d", rng.IntN(12))
	switch r := rng.IntN(10); {
	case r < 2:
		set(t, b, src, key)
		delete(st.hosts[src], key)
	case r < 3:
		ipa := netip.AddrFrom4([4]byte{10, 244, 0, byte(rng.IntN(4))})
		ns := fmt.Sprintf("ns%d", rng.IntN(3))
		if rng.IntN(3) == 0 {
			if err := b.SetClients(src, key, nil, ""); err != nil {
				t.Fatal(err)
			}
			delete(st.clients[src], key)
		} else {
			if err := b.SetClients(src, key, []netip.Addr{ipa}, ns); err != nil {
				t.Fatal(err)
			}
			st.clients[src][key] = clientRec{[]netip.Addr{ipa}, ns}
		}
	default:
		var hs []Host
		for range 1 + rng.IntN(3) {
			hs = append(hs, randHost(rng))
		}
		// One object never has two hosts of one name.
		hs = slices.CompactFunc(hs, func(a, b Host) bool { return a.Name == b.Name })
		seen := map[string]bool{}
		hs = slices.DeleteFunc(hs, func(h Host) bool {
			n, _ := NormName(h.Name)
			d := seen[n]
			seen[n] = true
			return d
		})
		set(t, b, src, key, hs...)
		st.hosts[src][key] = hs
	}
}

// fresh is the table a fresh builder makes from the state at once.
func (st *sourcesState) fresh(t *testing.T) *Table {
	t.Helper()
	f := newTestBuilder(t, st.srcs...)
	for _, s := range st.srcs {
		for k, hs := range st.hosts[s] {
			set(t, f, s, k, hs...)
		}
		for k, c := range st.clients[s] {
			if err := f.SetClients(s, k, c.ips, c.ns); err != nil {
				t.Fatal(err)
			}
		}
	}
	return publish(t, f)
}

// VIPs are sticky (a host keeps its VIP while it exists), so after a
// history of adds and removes they can differ from a fresh allocation;
// compare everything else.
func vipInsensitiveEqual(a, b string) bool {
	mask := func(s string) string {
		var out []string
		for _, l := range strings.Split(s, "\n") {
			if strings.Contains(l, "auto=true") {
				i := strings.Index(l, " v4=")
				j := strings.Index(l, " cname=")
				l = l[:i] + l[j:]
			}
			if strings.HasPrefix(l, "ptr 240.240.") || strings.HasPrefix(l, "ptr 2001:2::") {
				continue
			}
			out = append(out, l)
		}
		slices.Sort(out)
		return strings.Join(out, "\n")
	}
	return mask(a) == mask(b)
}

func TestMergeRules(t *testing.T) {
	b := newTestBuilder(t, "kubernetes", "cluster/east", "serviceentries")
	// A Service beats a ServiceEntry of the same host; local beats remote.
	set(t, b, "serviceentries", "ns1/se", Host{Name: "web.ns1.svc.cluster.local", V4: []netip.Addr{ip("240.240.0.9")}})
	set(t, b, "cluster/east", "ns1/web", Host{Name: "web.ns1.svc.cluster.local", Kubernetes: true, V4: []netip.Addr{ip("10.96.1.2")}})
	set(t, b, "kubernetes", "ns1/web", Host{Name: "web.ns1.svc.cluster.local", Kubernetes: true, V4: []netip.Addr{ip("10.96.0.1")}})
	// A headless Service answers the union of every cluster's endpoints.
	set(t, b, "kubernetes", "ns1/db", Host{Name: "db.ns1.svc.cluster.local", Kubernetes: true, Merge: true,
		V4: []netip.Addr{ip("10.244.0.1")}, Ports: []HostPort{{Name: "sql", Port: 5432, Target: "db-0.db.ns1.svc.cluster.local"}}})
	set(t, b, "cluster/east", "ns1/db", Host{Name: "db.ns1.svc.cluster.local", Kubernetes: true, Merge: true,
		V4: []netip.Addr{ip("10.245.0.1"), ip("10.244.0.1")}, Ports: []HostPort{{Name: "sql", Port: 5432, Target: "db-1.db.ns1.svc.cluster.local"}}})
	// Only in a remote cluster: its address answers.
	set(t, b, "cluster/east", "ns2/api", Host{Name: "api.ns2.svc.cluster.local", Kubernetes: true, V4: []netip.Addr{ip("10.97.0.5")}})
	tb := publish(t, b)
	check := func(name string, want ...string) {
		t.Helper()
		n, _ := tb.Find(name, netip.Addr{})
		var got []string
		if n != nil {
			for _, a := range append(slices.Clone(n.Host.V4), n.Host.V6...) {
				got = append(got, a.String())
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s = %v, want %v", name, got, want)
		}
	}
	check("web.ns1.svc.cluster.local.", "10.96.0.1")
	check("db.ns1.svc.cluster.local.", "10.244.0.1", "10.245.0.1")
	check("api.ns2.svc.cluster.local.", "10.97.0.5")
	if n, _ := tb.Find("db.ns1.svc.cluster.local.", netip.Addr{}); len(n.Host.Ports) != 2 {
		t.Fatalf("merged ports = %v", n.Host.Ports)
	}
	if got := tb.PTR("1.0.96.10.in-addr.arpa."); !slices.Equal(got, []string{"web.ns1.svc.cluster.local."}) {
		t.Fatalf("PTR of the winner = %v", got)
	}
	if got := tb.PTR("2.1.96.10.in-addr.arpa."); got != nil {
		t.Fatalf("PTR of a losing remote address = %v", got)
	}
	// The local Service goes away: the remote one answers.
	set(t, b, "kubernetes", "ns1/web")
	tb = publish(t, b)
	check("web.ns1.svc.cluster.local.", "10.96.1.2")
	set(t, b, "cluster/east", "ns1/web")
	tb = publish(t, b)
	check("web.ns1.svc.cluster.local.", "240.240.0.9")
}

func TestVisibility(t *testing.T) {
	b := newTestBuilder(t, "kubernetes", "serviceentries")
	if err := b.SetClients("kubernetes", "ns1/pod", []netip.Addr{ip("10.244.0.5")}, "ns1"); err != nil {
		t.Fatal(err)
	}
	if err := b.SetClients("kubernetes", "ns2/pod", []netip.Addr{ip("10.244.0.6")}, "ns2"); err != nil {
		t.Fatal(err)
	}
	set(t, b, "serviceentries", "ns1/a", Host{Name: "api.example.com", V4: []netip.Addr{ip("192.0.2.1")}, Extra: &HostExtra{Visible: []string{"ns1"}}})
	set(t, b, "serviceentries", "ns2/a", Host{Name: "api.example.com", V4: []netip.Addr{ip("192.0.2.2")}, Extra: &HostExtra{Visible: []string{"ns2"}}})
	set(t, b, "serviceentries", "ns3/a", Host{Name: "only.example.com", V4: []netip.Addr{ip("192.0.2.3")}, Extra: &HostExtra{Visible: []string{"ns3"}}})
	set(t, b, "serviceentries", "ns3/b", Host{Name: "all.example.com", V4: []netip.Addr{ip("192.0.2.4")}})
	// Exported to all from ns0 (sorts first) and to its own namespace from
	// ns1: ns1's clients get their own, everyone else the exported one.
	set(t, b, "serviceentries", "ns0/c", Host{Name: "both.example.com", V4: []netip.Addr{ip("192.0.2.5")}})
	set(t, b, "serviceentries", "ns1/c", Host{Name: "both.example.com", V4: []netip.Addr{ip("192.0.2.6")}, Extra: &HostExtra{Visible: []string{"ns1"}}})
	tb := publish(t, b)
	for _, tt := range []struct {
		client, name, want string
	}{
		{"10.244.0.5", "api.example.com.", "192.0.2.1"},
		{"10.244.0.6", "api.example.com.", "192.0.2.2"},
		{"10.244.9.9", "api.example.com.", ""}, // unknown client: only hosts exported to all
		{"10.244.0.5", "only.example.com.", ""},
		{"10.244.9.9", "all.example.com.", "192.0.2.4"},
		{"10.244.0.5", "all.example.com.", "192.0.2.4"},
		{"10.244.0.5", "both.example.com.", "192.0.2.6"},
		{"10.244.0.6", "both.example.com.", "192.0.2.5"},
		{"10.244.9.9", "both.example.com.", "192.0.2.5"},
	} {
		n, _ := tb.Find(tt.name, ip(tt.client))
		got := ""
		if n != nil {
			got = n.Host.V4[0].String()
		}
		if got != tt.want {
			t.Errorf("Find(%s) from %s = %q, want %q", tt.name, tt.client, got, tt.want)
		}
	}
}

func TestBareNamesAndENTs(t *testing.T) {
	b := newTestBuilder(t, "kubernetes")
	k := func(name, addr string) Host { return Host{Name: name, Kubernetes: true, V4: []netip.Addr{ip(addr)}} }
	set(t, b, "kubernetes", "a/web", k("web.a.svc.cluster.local", "10.0.0.1"))
	set(t, b, "kubernetes", "a/db-0", Host{Name: "db-0.db.a.svc.cluster.local", V4: []netip.Addr{ip("10.0.1.1")}})
	tb := publish(t, b)
	if n, _ := tb.Find("web.", netip.Addr{}); n == nil || n.Host.V4[0] != ip("10.0.0.1") {
		t.Fatalf("bare web with one namespace: %v", n)
	}
	for _, ent := range []string{"a.svc.cluster.local.", "svc.cluster.local.", "db.a.svc.cluster.local.", "cluster.local."} {
		if !tb.IsEmptyNonTerminal(ent) {
			t.Errorf("%s is not an ENT", ent)
		}
	}
	set(t, b, "kubernetes", "b/web", k("web.b.svc.cluster.local", "10.0.0.2"))
	tb = publish(t, b)
	if n, _ := tb.Find("web.", netip.Addr{}); n != nil {
		t.Fatalf("bare web is ambiguous but answers %v", n.Host.Name)
	}
	set(t, b, "kubernetes", "a/web")
	set(t, b, "kubernetes", "a/db-0")
	tb = publish(t, b)
	if n, _ := tb.Find("web.", netip.Addr{}); n == nil || n.Host.V4[0] != ip("10.0.0.2") {
		t.Fatalf("bare web back to one namespace: %v", n)
	}
	if tb.IsEmptyNonTerminal("a.svc.cluster.local.") || tb.IsEmptyNonTerminal("db.a.svc.cluster.local.") {
		t.Fatalf("ENTs of removed names remain")
	}
	if n, _ := tb.Find("web.b.", netip.Addr{}); n == nil {
		t.Fatalf("web.b. does not answer")
	}
	if n, _ := tb.Find("web.b.svc.", netip.Addr{}); n == nil {
		t.Fatalf("web.b.svc. does not answer")
	}
}

// A VIP never moves while its host exists, and hosts allocated in one
// batch get the same VIPs whatever order they were added in.
func TestVIPSticky(t *testing.T) {
	hosts := make([]Host, 200)
	for i := range hosts {
		hosts[i] = Host{Name: fmt.Sprintf("h%d.example.com", i), NeedVIP: true, Extra: &HostExtra{Order: fmt.Sprintf("%05d", i)}}
	}
	vipsOf := func(tb *Table) map[string]netip.Addr {
		m := map[string]netip.Addr{}
		for _, h := range hosts {
			n := tb.Lookup(h.Name + ".")
			if n == nil {
				continue
			}
			m[h.Name] = n.Host.V4[0]
		}
		return m
	}
	var first map[string]netip.Addr
	for trial := range 3 {
		b := newTestBuilder(t, "serviceentries")
		perm := rand.New(rand.NewPCG(uint64(trial), 7)).Perm(len(hosts))
		for _, i := range perm {
			set(t, b, "serviceentries", hosts[i].Name, hosts[i])
		}
		got := vipsOf(publish(t, b))
		if first == nil {
			first = got
		} else if fmt.Sprint(got) != fmt.Sprint(first) {
			t.Fatalf("trial %d: VIPs depend on the order of updates", trial)
		}
	}
	b := newTestBuilder(t, "serviceentries")
	for _, h := range hosts {
		set(t, b, "serviceentries", h.Name, h)
	}
	before := vipsOf(publish(t, b))
	// Remove half, add new hosts (some collide with freed slots), and
	// change the others: no surviving host moves.
	for i := 0; i < len(hosts); i += 2 {
		set(t, b, "serviceentries", hosts[i].Name)
	}
	for i := range 500 {
		h := Host{Name: fmt.Sprintf("new%d.example.com", i), NeedVIP: true}
		set(t, b, "serviceentries", h.Name, h)
	}
	for i := 1; i < len(hosts); i += 2 {
		h := hosts[i]
		h.Ports = []HostPort{{Name: "http", Port: 80}}
		set(t, b, "serviceentries", h.Name, h)
	}
	after := vipsOf(publish(t, b))
	for i := 1; i < len(hosts); i += 2 {
		if after[hosts[i].Name] != before[hosts[i].Name] {
			t.Fatalf("%s moved from %s to %s", hosts[i].Name, before[hosts[i].Name], after[hosts[i].Name])
		}
	}
	seen := map[netip.Addr]bool{}
	tb := b.Current()
	tb.names.each(func(_ string, e *Name) bool {
		if e.Host.AutoVIP {
			if seen[e.Host.V4[0]] {
				t.Fatalf("VIP %s handed out twice", e.Host.V4[0])
			}
			seen[e.Host.V4[0]] = true
		}
		return true
	})
}

func TestCNAMEHost(t *testing.T) {
	b := newTestBuilder(t, "kubernetes")
	set(t, b, "kubernetes", "ns/ext", Host{Name: "ext.ns.svc.cluster.local", Kubernetes: true, Extra: &HostExtra{CNAME: "Backend.Example.Org"}})
	tb := publish(t, b)
	n, _ := tb.Find("ext.ns.", netip.Addr{})
	if n == nil || n.Host.CNAME() != "backend.example.org." {
		t.Fatalf("ExternalName host: %+v", n)
	}
	if err := b.Set("kubernetes", "bad", []Host{{Name: "x.example.com", Extra: &HostExtra{CNAME: "y.example.com"}, V4: []netip.Addr{ip("10.0.0.1")}}}); err == nil {
		t.Fatalf("a CNAME host with addresses is accepted")
	}
}

func TestParseReverse(t *testing.T) {
	for _, s := range []string{"10.1.2.3", "255.0.0.1", "fd00::1", "2001:db8::abcd:1", "::"} {
		a := ip(s)
		got, ok := parseReverse(ReverseName(a))
		if !ok || got != a {
			t.Errorf("parseReverse(ReverseName(%s)) = %s, %v", a, got, ok)
		}
	}
	for _, bad := range []string{"1.2.3.in-addr.arpa.", "256.1.2.3.in-addr.arpa.", "01.1.2.3.in-addr.arpa.", "x.ip6.arpa.", "a.b.c.d.in-addr.arpa."} {
		if _, ok := parseReverse(bad); ok {
			t.Errorf("parseReverse(%q) accepted", bad)
		}
	}
}

// TestPTRSharedAddress: several hosts with one address all answer its PTR,
// sorted, as hosts come and go.
func TestPTRSharedAddress(t *testing.T) {
	b, err := NewBuilder(Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.AddSource("file", 0)
	const rev = "9.9.9.10.in-addr.arpa."
	steps := []struct {
		set, del string
		want     []string
	}{
		{set: "c.example.com", want: []string{"c.example.com."}},
		{set: "a.example.com", want: []string{"a.example.com.", "c.example.com."}},
		{set: "b.example.com", want: []string{"a.example.com.", "b.example.com.", "c.example.com."}},
		{del: "a.example.com", want: []string{"b.example.com.", "c.example.com."}},
		{del: "c.example.com", want: []string{"b.example.com."}},
		{del: "b.example.com", want: nil},
	}
	for _, s := range steps {
		if s.set != "" {
			set(t, b, "file", s.set, Host{Name: s.set, V4: []netip.Addr{ip("10.9.9.9")}})
		} else {
			set(t, b, "file", s.del)
		}
		if got := publish(t, b).PTR(rev); !slices.Equal(got, s.want) {
			t.Fatalf("after %s%s: PTR = %q, want %q", s.set, s.del, got, s.want)
		}
	}
}
