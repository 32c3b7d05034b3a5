package istioegress

import (
	"slices"
	"strings"
	"testing"

	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
)

var entries = []ServiceEntry{
	{Namespace: "shop", Name: "pay", Hosts: []string{"api.pay.example.com", "*.cdn.example.net"}},                     // everywhere
	{Namespace: "shop", Name: "local", Hosts: []string{"db.shop.example.org"}, ExportTo: []string{"."}},               // shop only
	{Namespace: "ops", Name: "to-web", Hosts: []string{"metrics.example.io"}, ExportTo: []string{"web", "."}},         // web and ops
	{Namespace: "ops", Name: "hidden", Hosts: []string{"secret.example.io"}, ExportTo: []string{"~"}},                 // nobody
	{Namespace: "ops", Name: "odd", Hosts: []string{"shortname", "*", "Upper.Example.COM."}, ExportTo: []string{"*"}}, // only the last is a name
}

// describe renders policies as "name ns=… except=… names…" lines.
func describe(ps []egresspolicy.Policy) []string {
	var out []string
	for _, p := range ps {
		if p.Source != SourceName || p.Mode != egresspolicy.Enforce || p.ClusterInternal {
			out = append(out, "bad fields: "+p.Name)
		}
		out = append(out, p.Name+" ns="+p.Namespace+" except="+strings.Join(p.ExcludeNamespaces, ",")+" "+strings.Join(p.Egress[0].Names, " "))
	}
	return out
}

func TestCompute(t *testing.T) {
	const everywhere = "*.cdn.example.net *.svc.cluster.local api.pay.example.com upper.example.com"
	for _, tc := range []struct {
		name string
		in   Inputs
		want []string
	}{
		{"allow any", Inputs{ServiceEntries: entries}, nil},
		{"mesh config", Inputs{MeshMode: RegistryOnly, ServiceEntries: entries}, []string{
			"mesh ns= except= " + everywhere,
			"ops ns=ops except= metrics.example.io",
			"shop ns=shop except= db.shop.example.org",
			"web ns=web except= metrics.example.io",
		}},
		{"mesh config, a namespace opts out", Inputs{MeshMode: RegistryOnly, ServiceEntries: entries, Sidecars: []Sidecar{
			{Namespace: "shop", Name: "default", Mode: AllowAny},
			{Namespace: "web", Name: "inherits"}, // no mode: the mesh's
			{Namespace: "ops", Name: "selected", Selector: true, Mode: AllowAny},
		}}, []string{
			"mesh ns= except=shop " + everywhere,
			"ops ns=ops except= metrics.example.io",
			"web ns=web except= metrics.example.io",
		}},
		{"root Sidecar overrides the mesh config", Inputs{MeshMode: AllowAny, ServiceEntries: entries, Sidecars: []Sidecar{
			{Namespace: "istio-system", Name: "default", Mode: RegistryOnly},
		}}, []string{
			"mesh ns= except= " + everywhere,
			"ops ns=ops except= metrics.example.io",
			"shop ns=shop except= db.shop.example.org",
			"web ns=web except= metrics.example.io",
		}},
		{"one namespace's Sidecar", Inputs{ServiceEntries: entries, Domain: "corp.local.", Sidecars: []Sidecar{
			{Namespace: "web", Name: "newer", Created: "2026-01-02T00:00:00Z", Mode: AllowAny},
			{Namespace: "web", Name: "older", Created: "2026-01-01T00:00:00Z", Mode: RegistryOnly},
			{Namespace: "shop", Name: "selected", Selector: true, Mode: RegistryOnly},
		}}, []string{
			"web ns=web except= *.cdn.example.net *.svc.corp.local api.pay.example.com metrics.example.io upper.example.com",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := describe(Compute(tc.in))
			if !slices.Equal(got, tc.want) {
				t.Fatalf("got\n  %s\nwant\n  %s", strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
			}
			// What a workload ends up with: the set combines them.
			if _, err := egresspolicy.NewSet(Compute(tc.in)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestComputedPoliciesCombinePerNamespace(t *testing.T) {
	set, err := egresspolicy.NewSet(Compute(Inputs{MeshMode: RegistryOnly, ServiceEntries: entries, FailMode: egresspolicy.FailClosed}))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ns, name string
		want     bool
	}{
		{"web", "metrics.example.io", true},
		{"web", "db.shop.example.org", false},
		{"shop", "db.shop.example.org", true},
		{"shop", "x.y.cdn.example.net", true},
		{"other", "reviews.default.svc.cluster.local", true},
		{"other", "secret.example.io", false},
		{"other", "example.com", false},
	} {
		p, ok := set.Select(egresspolicy.Workload{Namespace: tc.ns})
		if !ok || p.FailMode != egresspolicy.FailClosed {
			t.Fatalf("%s: not selected (%v) or not fail-closed", tc.ns, ok)
		}
		if _, got := p.Allows(tc.name); got != tc.want {
			t.Errorf("%s may use %s: %v, want %v", tc.ns, tc.name, got, tc.want)
		}
	}
}

func TestNewNeedsTheServiceEntrySource(t *testing.T) {
	if _, err := New(&rest.Config{Host: "https://127.0.0.1:1"}, Options{}); err == nil || !strings.Contains(err.Error(), "ServiceEntry source") {
		t.Fatalf("err = %v", err)
	}
}
