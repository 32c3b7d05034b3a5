package egresspolicy

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func valid() Policy {
	return Policy{Source: "test", Name: "ns/p", Namespace: "ns", Mode: Enforce, FailMode: FailOpen,
		Egress: []Rule{{Names: []string{"api.example.com"}, Ports: []Port{{443, TCP}}}}}
}

func TestValidateNamesEveryProblemWithItsField(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Policy)
		want []string // field paths, in order
	}{
		{"valid", func(*Policy) {}, nil},
		{"wildcard and trailing dot", func(p *Policy) {
			p.Egress[0].Names = []string{"*.example.com.", "Example.COM", "_srv._tcp.example.com"}
		}, nil},
		{"empty name", func(p *Policy) { p.Egress[0].Names = []string{""} }, []string{"egress[0].names[0]"}},
		{"no names", func(p *Policy) { p.Egress[0].Names = nil }, []string{"egress[0].names"}},
		{"no rules", func(p *Policy) { p.Egress = nil }, []string{"egress"}},
		{"star alone", func(p *Policy) { p.Egress[0].Names = []string{"*"} }, []string{"egress[0].names[0]"}},
		{"star in the middle", func(p *Policy) { p.Egress[0].Names = []string{"a.*.b"} }, []string{"egress[0].names[0]"}},
		{"partial star", func(p *Policy) { p.Egress[0].Names = []string{"*a.example.com"} }, []string{"egress[0].names[0]"}},
		{"double star", func(p *Policy) { p.Egress[0].Names = []string{"**.example.com"} }, []string{"egress[0].names[0]"}},
		{"star dot only", func(p *Policy) { p.Egress[0].Names = []string{"*."} }, []string{"egress[0].names[0]"}},
		{"bad characters", func(p *Policy) {
			p.Egress[0].Names = []string{"a b.com", "x..com", "-a.com", strings.Repeat("a", 64) + ".com"}
		},
			[]string{"egress[0].names[0]", "egress[0].names[1]", "egress[0].names[2]", "egress[0].names[3]"}},
		{"ports", func(p *Policy) { p.Egress[0].Ports = []Port{{0, TCP}, {65536, UDP}, {53, "SCTP"}, {65535, UDP}} },
			[]string{"egress[0].ports[0].port", "egress[0].ports[1].port", "egress[0].ports[2].protocol"}},
		{"modes", func(p *Policy) { p.Mode, p.FailMode = "deny", "closed" }, []string{"mode", "failMode"}},
		{"selector", func(p *Policy) {
			p.PodSelector = Selector{MatchExpressions: []Requirement{
				{Key: "app", Operator: In}, {Key: "", Operator: Exists}, {Key: "t", Operator: Exists, Values: []string{"x"}},
				{Key: "t", Operator: "Like", Values: []string{"x"}}, {Key: "t", Operator: NotIn, Values: []string{"-bad"}}}}
		}, []string{"podSelector.matchExpressions[0].values", "podSelector.matchExpressions[1].key",
			"podSelector.matchExpressions[2].values", "podSelector.matchExpressions[3].operator", "podSelector.matchExpressions[4].values[0]"}},
		{"selector labels", func(p *Policy) { p.PodSelector = Selector{MatchLabels: map[string]string{"bad key": "ok"}} }, []string{"podSelector.matchLabels"}},
		{"unit with a selector", func(p *Policy) {
			p.Namespace, p.Unit = "", "app.service"
			p.PodSelector = Selector{MatchLabels: map[string]string{"a": "b"}}
		}, []string{"podSelector"}},
		{"bad unit", func(p *Policy) { p.Namespace, p.Unit = "", "app" }, []string{"unit"}},
		{"exclusions of one namespace", func(p *Policy) { p.ExcludeNamespaces = []string{"x"} }, []string{"excludeNamespaces"}},
		{"many at once", func(p *Policy) {
			p.Mode = "x"
			p.Egress = append(p.Egress, Rule{Names: []string{"ok.com", "a.*.b"}, Ports: []Port{{-1, TCP}}})
		}, []string{"mode", "egress[1].names[1]", "egress[1].ports[0].port"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := valid()
			tc.edit(&p)
			err := p.Validate()
			var got []string
			var ps Problems
			if errors.As(err, &ps) {
				for _, pr := range ps {
					got = append(got, pr.Field)
				}
			} else if err != nil {
				t.Fatalf("error is not Problems: %v", err)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("problems at %q, want %q (%v)", got, tc.want, err)
			}
		})
	}
}

func TestDefaultFillsModesAndProtocol(t *testing.T) {
	p := Policy{Namespace: "ns", Egress: []Rule{{Names: []string{"a.com"}, Ports: []Port{{Port: 443}}}}}
	p.Default()
	if p.Mode != Enforce || p.FailMode != FailOpen || p.Egress[0].Ports[0].Protocol != TCP {
		t.Fatalf("defaults: %+v", p)
	}
	if err := p.Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestProblemsPrefixed(t *testing.T) {
	p := valid()
	p.Mode = "x"
	var ps Problems
	if !errors.As(p.Validate(), &ps) {
		t.Fatal("no problems")
	}
	if got := ps.Prefixed("spec.").Error(); !strings.HasPrefix(got, `spec.mode: "x" is not a mode`) {
		t.Fatalf("got %q", got)
	}
}

func mustSet(t testing.TB, ps ...Policy) *Set {
	t.Helper()
	s, err := NewSet(ps)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func fmtPorts(ps []Port, ok bool) string {
	if !ok {
		return "denied"
	}
	if ps == nil {
		return "any"
	}
	var s []string
	for _, p := range ps {
		s = append(s, fmt.Sprintf("%d/%s", p.Port, p.Protocol))
	}
	return strings.Join(s, ",")
}

func TestAllows(t *testing.T) {
	p := valid()
	p.Egress = []Rule{
		{Names: []string{"api.example.com", "Mixed.Example.ORG."}, Ports: []Port{{443, TCP}}},
		{Names: []string{"*.example.com"}, Ports: []Port{{80, TCP}}},
		{Names: []string{"*.deep.example.com", "db.internal"}, Ports: []Port{{5432, TCP}, {443, TCP}, {5432, TCP}}},
		{Names: []string{"anyport.net"}},
		{Names: []string{"api.example.com"}, Ports: []Port{{8443, UDP}}},
	}
	pol, ok := mustSet(t, p).Select(Workload{Namespace: "ns"})
	if !ok {
		t.Fatal("not selected")
	}
	for _, tc := range []struct{ name, want string }{
		{"api.example.com", "80/TCP,443/TCP,8443/UDP"}, // exact + wildcard + the same name again
		{"API.EXAMPLE.COM.", "80/TCP,443/TCP,8443/UDP"},
		{"www.example.com", "80/TCP"},
		{"a.b.c.example.com", "80/TCP"}, // every depth
		{"example.com", "denied"},       // not the apex
		{"x.deep.example.com", "80/TCP,443/TCP,5432/TCP"},
		{"deep.example.com", "80/TCP"},
		{"mixed.example.org", "443/TCP"},
		{"db.internal", "443/TCP,5432/TCP"},
		{"db.internal.", "443/TCP,5432/TCP"},
		{"anyport.net", "any"},
		{"sub.anyport.net", "denied"},
		{"notexample.com", "denied"},
		{"com", "denied"},
		{"", "denied"},
		{".", "denied"},
		{"example.com.evil.net", "denied"},
	} {
		if got := fmtPorts(pol.Allows(tc.name)); got != tc.want {
			t.Errorf("Allows(%q) = %s, want %s", tc.name, got, tc.want)
		}
	}
	var nilPolicy *Policy
	if _, ok := nilPolicy.Allows("a.com"); ok {
		t.Error("a nil policy allows")
	}
}

func TestSelectorMatches(t *testing.T) {
	labels := map[string]string{"app": "web", "tier": "front"}
	for _, tc := range []struct {
		name string
		s    Selector
		want bool
	}{
		{"empty", Selector{}, true},
		{"labels", Selector{MatchLabels: map[string]string{"app": "web"}}, true},
		{"labels mismatch", Selector{MatchLabels: map[string]string{"app": "db"}}, false},
		{"labels missing", Selector{MatchLabels: map[string]string{"x": ""}}, false},
		{"in", Selector{MatchExpressions: []Requirement{{"tier", In, []string{"back", "front"}}}}, true},
		{"in missing key", Selector{MatchExpressions: []Requirement{{"x", In, []string{"a"}}}}, false},
		{"notin", Selector{MatchExpressions: []Requirement{{"tier", NotIn, []string{"front"}}}}, false},
		{"notin missing key", Selector{MatchExpressions: []Requirement{{"x", NotIn, []string{"a"}}}}, true},
		{"exists", Selector{MatchExpressions: []Requirement{{"app", Exists, nil}}}, true},
		{"exists missing", Selector{MatchExpressions: []Requirement{{"x", Exists, nil}}}, false},
		{"doesnotexist", Selector{MatchExpressions: []Requirement{{"x", DoesNotExist, nil}}}, true},
		{"doesnotexist present", Selector{MatchExpressions: []Requirement{{"app", DoesNotExist, nil}}}, false},
		{"all must hold", Selector{MatchLabels: map[string]string{"app": "web"},
			MatchExpressions: []Requirement{{"tier", In, []string{"back"}}}}, false},
	} {
		if got := tc.s.Matches(labels); got != tc.want {
			t.Errorf("%s: Matches = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestSelectAndCombine(t *testing.T) {
	web := valid()
	web.Name = "ns/web"
	web.PodSelector = Selector{MatchLabels: map[string]string{"app": "web"}}
	web.Mode = Audit
	web.Egress = []Rule{{Names: []string{"a.com"}, Ports: []Port{{443, TCP}}}}

	all := valid()
	all.Name = "ns/all"
	all.FailMode = FailClosed
	all.Egress = []Rule{{Names: []string{"b.com"}}, {Names: []string{"a.com"}, Ports: []Port{{80, TCP}}}}

	internal := valid()
	internal.Name = "ns/internal"
	internal.Mode = Audit
	internal.ClusterInternal = true
	internal.PodSelector = Selector{MatchLabels: map[string]string{"app": "db"}}

	vm := Policy{Source: "file", Name: "app", Unit: "app.service", Mode: Audit, FailMode: FailOpen,
		Egress: []Rule{{Names: []string{"vm.example.com"}}}}

	s := mustSet(t, web, all, internal, vm)
	if s.Len() != 4 {
		t.Fatalf("Len = %d", s.Len())
	}

	// One policy: returned as it is.
	p, ok := s.Select(Workload{Namespace: "ns", Labels: map[string]string{"app": "other"}})
	if !ok || p.ID() != "test ns/all" {
		t.Fatalf("other pod: %v %v", p, ok)
	}
	// Another namespace, a VM unit that no policy names: nothing.
	for _, w := range []Workload{{Namespace: "other", Labels: map[string]string{"app": "web"}}, {Unit: "db.service"}} {
		if p, ok := s.Select(w); ok {
			t.Fatalf("%+v selected by %s", w, p.ID())
		}
	}
	// A VM unit selects only its policy, never the pod policies.
	if p, ok := s.Select(Workload{Unit: "app.service"}); !ok || p.ID() != "file app" {
		t.Fatalf("unit: %v %v", p, ok)
	}

	// web + all: enforce beats audit, fail-closed beats fail-open, names union
	// with each name's own ports.
	w := Workload{Namespace: "ns", Labels: map[string]string{"app": "web"}}
	p, ok = s.Select(w)
	if !ok || p.Mode != Enforce || p.FailMode != FailClosed || p.ClusterInternal {
		t.Fatalf("combined: %+v", p)
	}
	if got := fmtPorts(p.Allows("a.com")); got != "80/TCP,443/TCP" {
		t.Errorf("a.com: %s", got)
	}
	if got := fmtPorts(p.Allows("b.com")); got != "any" {
		t.Errorf("b.com: %s", got)
	}
	if got := fmtPorts(p.Allows("c.com")); got != "denied" {
		t.Errorf("c.com: %s", got)
	}
	if !strings.Contains(p.Name, "test ns/all") || !strings.Contains(p.Name, "test ns/web") {
		t.Errorf("combined name %q", p.Name)
	}
	if again, _ := s.Select(w); again != p {
		t.Error("the combination was built twice")
	}

	// internal + all: cluster-internal in scope if any says so.
	if p, _ := s.Select(Workload{Namespace: "ns", Labels: map[string]string{"app": "db"}}); !p.ClusterInternal || p.Mode != Enforce {
		t.Errorf("db: %+v", p)
	}

	// A policy of every namespace, but one.
	mesh := valid()
	mesh.Name, mesh.Namespace, mesh.ExcludeNamespaces = "mesh", "", []string{"open"}
	mesh.Egress = []Rule{{Names: []string{"*.svc.cluster.local"}}}
	ms := mustSet(t, mesh, web)
	for _, tc := range []struct {
		w    Workload
		want string
	}{
		{Workload{Namespace: "any"}, "test mesh"},
		{Workload{Namespace: "open"}, ""},
		{Workload{Unit: "app.service"}, ""},
		{Workload{Namespace: "ns", Labels: map[string]string{"app": "web"}}, "test mesh, test ns/web"},
	} {
		p, ok := ms.Select(tc.w)
		got := ""
		if ok {
			got = p.ID()
			if p.Source == "combined" {
				got = p.Name
			}
		}
		if got != tc.want {
			t.Errorf("%+v: selected by %q, want %q", tc.w, got, tc.want)
		}
	}

	var empty *Set
	if _, ok := empty.Select(w); ok || empty.Len() != 0 {
		t.Error("a nil set selects")
	}
}

func TestNewSetRefusesInvalidAndDuplicates(t *testing.T) {
	bad := valid()
	bad.Name = "ns/bad"
	bad.Egress[0].Names = []string{"*"}
	_, err := NewSet([]Policy{valid(), bad, valid()})
	if err == nil || !strings.Contains(err.Error(), "test ns/bad: egress[0].names[0]") || !strings.Contains(err.Error(), "listed twice") {
		t.Fatalf("err = %v", err)
	}
}

func TestSetOwnsItsPolicies(t *testing.T) {
	p := valid()
	s := mustSet(t, p)
	p.Egress[0].Names[0] = "changed.example.com"
	got, _ := s.Select(Workload{Namespace: "ns"})
	if _, ok := got.Allows("api.example.com"); !ok {
		t.Fatal("the caller's later change reached the set")
	}
}

// BenchmarkAllows is the query path: 1,000 names, a quarter of them
// wildcards, looked up as hits (exact and wildcard at depth) and misses.
func BenchmarkAllows(b *testing.B) {
	var names []string
	for i := range 1000 {
		if i%4 == 0 {
			names = append(names, fmt.Sprintf("*.svc%d.example.com", i))
		} else {
			names = append(names, fmt.Sprintf("api%d.example.com", i))
		}
	}
	p := valid()
	p.Egress = []Rule{{Names: names, Ports: []Port{{443, TCP}}}}
	pol, _ := mustSet(b, p).Select(Workload{Namespace: "ns"})
	queries := []string{"api999.example.com", "a.b.svc996.example.com", "nothing.example.net", "x.api1.example.com"}
	want := []bool{true, true, false, false}
	for i, q := range queries {
		if _, ok := pol.Allows(q); ok != want[i] {
			b.Fatalf("Allows(%q) = %v", q, ok)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		pol.Allows(queries[i%len(queries)])
	}
}
