package ndssource

import (
	"fmt"
	"log/slog"
	"net/netip"
	"reflect"
	"slices"
	"testing"

	nds "istio.io/istio/pkg/dns/proto"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// recSink records what the merger hands the store.
type recSink struct {
	hosts map[string][]nametable.Host
	sets  int
}

func (r *recSink) Set(key string, hosts []nametable.Host) error {
	r.sets++
	if len(hosts) == 0 {
		delete(r.hosts, key)
		return nil
	}
	r.hosts[key] = hosts
	return nil
}
func (r *recSink) SetClients(string, []netip.Addr, string) error { return nil }
func (r *recSink) Apply(*nametable.Change) error                 { return nil }

func (r *recSink) Load(map[string]nametable.Host, map[netip.Addr]string) error { return nil }
func (r *recSink) Audit(int) error                                             { return nil }
func (r *recSink) Synced()                                                     {}
func (r *recSink) Failed(error)                                                {}
func newRec() *recSink                                                         { return &recSink{hosts: map[string][]nametable.Host{}} }
func table(entries map[string]*nds.NameTable_NameInfo) *nds.NameTable {
	return &nds.NameTable{Table: entries}
}
func ext(ips ...string) *nds.NameTable_NameInfo {
	return &nds.NameTable_NameInfo{Ips: ips, Registry: "External"}
}
func addrs(s ...string) (out []netip.Addr) {
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

// summary is name -> "visible:addresses" per host, sorted.
func summary(r *recSink) map[string][]string {
	out := map[string][]string{}
	for k, hs := range r.hosts {
		for _, h := range hs {
			vis := "*"
			if h.Visible() != nil {
				vis = fmt.Sprint(h.Visible())
			}
			out[k] = append(out[k], fmt.Sprintf("%s:%v%v", vis, h.V4, h.V6))
		}
		slices.Sort(out[k])
	}
	return out
}

// A host every view has alike is visible to everyone; one only some views
// have (or have differently) is visible to those namespaces.
func TestMergeViews(t *testing.T) {
	r := newRec()
	m := newMerger(r, "cluster.local", slog.Default())
	m.want("apps")
	m.want("shop")
	m.apply("apps", table(map[string]*nds.NameTable_NameInfo{
		"a.example.com": ext("192.0.2.1"), "b.example.com": ext("192.0.2.2"), "d.example.com": ext("192.0.2.4")}))
	m.apply("shop", table(map[string]*nds.NameTable_NameInfo{
		"a.example.com": ext("192.0.2.1"), "c.example.com": ext("192.0.2.3"), "d.example.com": ext("192.0.2.5")}))
	want := map[string][]string{
		"a.example.com": {"*:[192.0.2.1][]"},
		"b.example.com": {"[apps]:[192.0.2.2][]"},
		"c.example.com": {"[shop]:[192.0.2.3][]"},
		"d.example.com": {"[apps]:[192.0.2.4][]", "[shop]:[192.0.2.5][]"},
	}
	if got := summary(r); !reflect.DeepEqual(got, want) {
		t.Fatalf("merged:\n got %v\nwant %v", got, want)
	}
	if !m.initialDone("apps") {
		t.Error("both views have a table: initial sync should be done")
	}

	// The same content again, addresses reordered: nothing changes.
	r.sets = 0
	m.apply("apps", table(map[string]*nds.NameTable_NameInfo{
		"a.example.com": ext("192.0.2.1"), "b.example.com": ext("192.0.2.2"), "d.example.com": ext("192.0.2.4")}))
	if r.sets != 0 {
		t.Errorf("an unchanged push made %d Set calls, want 0", r.sets)
	}
	// One name changes: one Set.
	m.apply("apps", table(map[string]*nds.NameTable_NameInfo{
		"a.example.com": ext("192.0.2.1"), "b.example.com": ext("192.0.2.9"), "d.example.com": ext("192.0.2.4")}))
	if r.sets != 1 || summary(r)["b.example.com"][0] != "[apps]:[192.0.2.9][]" {
		t.Errorf("after one change: %d Set calls, b = %v", r.sets, summary(r)["b.example.com"])
	}
	// The shop view goes (no Pod of shop left): its names go, and what
	// apps alone has becomes everyone's.
	m.drop("shop")
	want = map[string][]string{
		"a.example.com": {"*:[192.0.2.1][]"}, "b.example.com": {"*:[192.0.2.9][]"}, "d.example.com": {"*:[192.0.2.4][]"},
	}
	if got := summary(r); !reflect.DeepEqual(got, want) {
		t.Fatalf("after dropping shop:\n got %v\nwant %v", got, want)
	}
	if len(m.intern) != 3 {
		t.Errorf("%d interned hosts, want 3 (the dropped view's are released)", len(m.intern))
	}
}

// Whatever order the views' pushes arrive in, and whatever tables came
// before, the result depends only on the final tables.
func TestMergeOrderIndependent(t *testing.T) {
	final := map[string]*nds.NameTable{
		"apps": table(map[string]*nds.NameTable_NameInfo{"a.example.com": ext("192.0.2.1"), "b.example.com": ext("192.0.2.2")}),
		"shop": table(map[string]*nds.NameTable_NameInfo{"a.example.com": ext("192.0.2.1"), "b.example.com": ext("192.0.2.3")}),
		"web":  table(map[string]*nds.NameTable_NameInfo{"a.example.com": ext("192.0.2.1")}),
	}
	early := table(map[string]*nds.NameTable_NameInfo{"a.example.com": ext("192.0.2.7"), "z.example.com": ext("192.0.2.8")})
	var ref map[string][]string
	for i, order := range [][]string{{"apps", "shop", "web"}, {"web", "shop", "apps"}, {"shop", "web", "apps"}} {
		r := newRec()
		m := newMerger(r, "cluster.local", slog.Default())
		for _, ns := range order {
			m.want(ns)
		}
		for _, ns := range order {
			m.apply(ns, early) // an older state first
		}
		for _, ns := range order {
			m.apply(ns, final[ns])
		}
		got := summary(r)
		if i == 0 {
			ref = got
			if len(got) != 2 || got["a.example.com"][0] != "*:[192.0.2.1][]" {
				t.Fatalf("merged %v", got)
			}
			continue
		}
		if !reflect.DeepEqual(got, ref) {
			t.Errorf("order %v:\n got %v\nwant %v", order, got, ref)
		}
	}
}

// NameTable entries read as the Istio agent reads them.
func TestHostOf(t *testing.T) {
	svc := hostOf("web.apps.svc.cluster.local", &nds.NameTable_NameInfo{Ips: []string{"10.96.0.5", "fd00::5", "not-an-ip"},
		Registry: "Kubernetes", Shortname: "web", Namespace: "apps"}, "cluster.local")
	if !svc.Kubernetes || !slices.Equal(svc.V4, addrs("10.96.0.5")) || !slices.Equal(svc.V6, addrs("fd00::5")) || len(svc.AltNames()) != 0 {
		t.Errorf("service: %+v", svc)
	}
	pod := hostOf("db-0.db.apps.svc.cluster.local", &nds.NameTable_NameInfo{Ips: []string{"10.244.1.10"},
		Registry: "Kubernetes", Shortname: "db-0.db", Namespace: "apps"}, "cluster.local")
	if pod.Kubernetes || !slices.Equal(pod.AltNames(), []string{"db-0.db.apps", "db-0.db.apps.svc"}) {
		t.Errorf("headless pod entry: %+v", pod)
	}
	se := hostOf("api.example.com", &nds.NameTable_NameInfo{Ips: []string{"240.240.0.1"}, Registry: "External", AltHosts: []string{"api.internal"}}, "cluster.local")
	if se.Kubernetes || se.NeedVIP || !slices.Equal(se.AltNames(), []string{"api.internal"}) {
		t.Errorf("ServiceEntry: %+v", se)
	}
	// A Kubernetes entry whose shortname does not match its name gets no
	// short names (a clusterset.local name, say).
	mcs := hostOf("web.apps.svc.clusterset.local", &nds.NameTable_NameInfo{Ips: []string{"10.96.0.6"}, Registry: "Kubernetes", Shortname: "web", Namespace: "apps"}, "cluster.local")
	if mcs.Kubernetes || len(mcs.AltNames()) != 0 {
		t.Errorf("clusterset name: %+v", mcs)
	}
}
