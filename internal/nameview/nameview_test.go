package nameview

import (
	"bytes"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

func ips(s ...string) []netip.Addr {
	var out []netip.Addr
	for _, a := range s {
		out = append(out, netip.MustParseAddr(a))
	}
	return out
}

// testTable: a ClusterIP Service, a headless Service with an endpoint, an
// ExternalName, a remote cluster's Service, ServiceEntries (one exported
// to its namespace only, one to everyone, same host), a VIP host with an
// alternative name, and a wildcard.
func testTable(t *testing.T) *nametable.Table {
	t.Helper()
	b, err := nametable.NewBuilder(nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.AddSource("kubernetes", 80)
	b.AddSource("cluster/east", 60)
	b.AddSource("serviceentries", 40)
	b.AddSource("file", 100)
	set := func(src, key string, hs ...nametable.Host) {
		t.Helper()
		if err := b.Set(src, key, hs); err != nil {
			t.Fatal(err)
		}
	}
	set("kubernetes", "default/web", nametable.Host{Name: "web.default.svc.cluster.local", Kubernetes: true, V4: ips("10.96.0.10"),
		Ports: []nametable.HostPort{{Name: "http", Protocol: "tcp", Port: 80}}})
	set("kubernetes", "default/db",
		nametable.Host{Name: "db.default.svc.cluster.local", Kubernetes: true, Merge: true, NoPTR: true, V4: ips("10.244.1.5"),
			Ports: []nametable.HostPort{{Name: "sql", Protocol: "tcp", Port: 5432, Target: "db-0.db.default.svc.cluster.local"}}},
		nametable.Host{Name: "db-0.db.default.svc.cluster.local", Merge: true, V4: ips("10.244.1.5")})
	set("kubernetes", "default/ext", nametable.Host{Name: "ext.default.svc.cluster.local", Kubernetes: true, Extra: &nametable.HostExtra{CNAME: "ext.example.org"}})
	set("cluster/east", "shop/cart", nametable.Host{Name: "cart.shop.svc.cluster.local", Kubernetes: true, V4: ips("10.96.5.5")})
	set("serviceentries", "apps/private", nametable.Host{Name: "api.example.com", V4: ips("192.0.2.1"), Extra: &nametable.HostExtra{Visible: []string{"apps"}}})
	set("serviceentries", "infra/public", nametable.Host{Name: "api.example.com", V4: ips("192.0.2.2")})
	set("serviceentries", "infra/wild", nametable.Host{Name: "*.wild.example.com", V4: ips("192.0.2.3")})
	set("file", "vip.example.com", nametable.Host{Name: "vip.example.com", NeedVIP: true, Extra: &nametable.HostExtra{AltNames: []string{"alias.example.com"}}})
	tab, err := b.Publish()
	if err != nil {
		t.Fatal(err)
	}
	return tab
}

func TestList(t *testing.T) {
	tab := testTable(t)
	names := func(es []Entry) string {
		var s []string
		for _, e := range es {
			s = append(s, e.Name+"="+strings.Join(e.Addresses, ",")+e.CNAME+"@"+strings.Join(e.VisibleTo, ","))
		}
		return strings.Join(s, " ")
	}
	tests := []struct {
		name string
		f    Filter
		want string
	}{
		{"all, both variants of api.example.com", Filter{},
			"*.wild.example.com=192.0.2.3@* alias.example.com=240.240.114.170,2001:2::f0f0:72aa@* api.example.com=192.0.2.1@apps api.example.com=192.0.2.2@* " +
				"cart.shop.svc.cluster.local=10.96.5.5@* db-0.db.default.svc.cluster.local=10.244.1.5@* db.default.svc.cluster.local=10.244.1.5@* " +
				"ext.default.svc.cluster.local=ext.example.org@* vip.example.com=240.240.114.170,2001:2::f0f0:72aa@* web.default.svc.cluster.local=10.96.0.10@*"},
		{"name substring", Filter{Name: "DB."}, "db-0.db.default.svc.cluster.local=10.244.1.5@* db.default.svc.cluster.local=10.244.1.5@*"},
		{"name glob", Filter{Name: "*.example.com."}, "*.wild.example.com=192.0.2.3@* alias.example.com=240.240.114.170,2001:2::f0f0:72aa@* api.example.com=192.0.2.1@apps api.example.com=192.0.2.2@* vip.example.com=240.240.114.170,2001:2::f0f0:72aa@*"},
		{"namespace of the object", Filter{Namespace: "infra"}, "*.wild.example.com=192.0.2.3@* api.example.com=192.0.2.2@*"},
		{"namespace of a Service", Filter{Namespace: "shop"}, "cart.shop.svc.cluster.local=10.96.5.5@*"},
		{"source glob", Filter{Source: "cluster/*"}, "cart.shop.svc.cluster.local=10.96.5.5@*"},
		{"source", Filter{Source: "serviceentries", Name: "api"}, "api.example.com=192.0.2.1@apps api.example.com=192.0.2.2@*"},
		{"client view of apps", Filter{Client: "apps", Name: "api"}, "api.example.com=192.0.2.1@apps"},
		{"client view of team-b", Filter{Client: "team-b", Name: "api"}, "api.example.com=192.0.2.2@*"},
		// apps gets apps/private: filtered out, it does not fall back to
		// the entry other clients get.
		{"client view filtered", Filter{Client: "apps", Name: "api", Namespace: "infra"}, ""},
	}
	for _, tt := range tests {
		if got := names(List(tab, tt.f)); got != tt.want {
			t.Errorf("%s:\n got %s\nwant %s", tt.name, got, tt.want)
		}
	}
}

func TestWriteTable(t *testing.T) {
	tab := testTable(t)
	var b bytes.Buffer
	if err := WriteTable(&b, List(tab, Filter{Name: "default"})); err != nil {
		t.Fatal(err)
	}
	want := `NAME                               TYPE      ADDRESSES              SOURCE                  VISIBLE-TO
db-0.db.default.svc.cluster.local  endpoint  10.244.1.5             kubernetes default/db   *
db.default.svc.cluster.local       headless  10.244.1.5             kubernetes default/db   *
ext.default.svc.cluster.local      cname     CNAME ext.example.org  kubernetes default/ext  *
web.default.svc.cluster.local      service   10.96.0.10             kubernetes default/web  *
`
	if b.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", b.String(), want)
	}
	b.Reset()
	if err := WriteTable(&b, List(tab, Filter{Name: "alias"})); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "vip (alias of vip.example.com)") {
		t.Errorf("alias row:\n%s", b.String())
	}
}

// NDS gives Istio's NameTable JSON: canonical hosts with addresses as the
// client's namespace sees them.
func TestNDS(t *testing.T) {
	tab := testTable(t)
	for _, tt := range []struct {
		ns, want string
	}{
		{"apps", `{"table":{` +
			`"*.wild.example.com":{"ips":["192.0.2.3"],"registry":"External"},` +
			`"api.example.com":{"ips":["192.0.2.1"],"registry":"External"},` +
			`"cart.shop.svc.cluster.local":{"ips":["10.96.5.5"],"registry":"Kubernetes","shortname":"cart","namespace":"shop"},` +
			`"db-0.db.default.svc.cluster.local":{"ips":["10.244.1.5"],"registry":"Kubernetes"},` +
			`"db.default.svc.cluster.local":{"ips":["10.244.1.5"],"registry":"Kubernetes","shortname":"db","namespace":"default"},` +
			`"vip.example.com":{"ips":["240.240.114.170","2001:2::f0f0:72aa"],"registry":"External","altHosts":["alias.example.com"]},` +
			`"web.default.svc.cluster.local":{"ips":["10.96.0.10"],"registry":"Kubernetes","shortname":"web","namespace":"default"}}}`},
		{"", `"api.example.com":{"ips":["192.0.2.2"],"registry":"External"}`},
	} {
		b, err := json.Marshal(NDS(tab, tt.ns))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), tt.want) {
			t.Errorf("ndsz for %q:\n got %s\nwant %s", tt.ns, b, tt.want)
		}
	}
}
