package meshsource

import (
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// entry builds an unstructured ServiceEntry in namespace ns from a spec
// and an optional status.
func entry(ns string, spec, status map[string]any) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "networking.istio.io/v1",
		"kind":       "ServiceEntry",
		"spec":       spec,
	}}
	if status != nil {
		u.Object["status"] = status
	}
	u.SetNamespace(ns)
	u.SetName("se")
	u.SetUID(types.UID("0b6e2f1c-0000-4000-8000-000000000001"))
	u.SetCreationTimestamp(metav1.NewTime(time.Date(2025, 3, 4, 5, 6, 7, 0, time.UTC)))
	return u
}

func list(v ...string) []any {
	out := make([]any, len(v))
	for i, s := range v {
		out[i] = s
	}
	return out
}

// renderHosts prints hosts in a stable, readable form.
func renderHosts(hs []nametable.Host) string {
	var parts []string
	for _, h := range hs {
		s := h.Name
		for _, a := range append(append([]any{}, toAny(h.V4)...), toAny(h.V6)...) {
			s += fmt.Sprintf(" %v", a)
		}
		if h.NeedVIP {
			s += " VIP"
		}
		if h.Visible() != nil {
			s += " visible:" + strings.Join(h.Visible(), ",")
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

func toAny[T any](v []T) []any {
	out := make([]any, len(v))
	for i := range v {
		out[i] = v[i]
	}
	return out
}

// entryHostsCase is one ServiceEntry (its spec and status) and the hosts it
// answers (renderHosts) and the errors of those it skips.
type entryHostsCase struct {
	name           string
	spec, status   map[string]any
	want, wantBad  string
	wantOrderEmpty bool
}

var entryHostsCases = []entryHostsCase{
	{
		name: "spec.addresses answer every host; CIDRs are skipped",
		spec: map[string]any{"hosts": list("api.example.com", "API.example.org."), "resolution": "STATIC",
			"addresses": list("192.0.2.10", "10.0.0.0/8", "2001:db8::10", "::ffff:192.0.2.11")},
		want: "api.example.com. 192.0.2.10 192.0.2.11 2001:db8::10; api.example.org. 192.0.2.10 192.0.2.11 2001:db8::10",
	},
	{
		name: "status.addresses of each host when spec has none",
		spec: map[string]any{"hosts": list("a.example.com", "b.example.com"), "resolution": "DNS"},
		status: map[string]any{"addresses": []any{
			map[string]any{"value": "240.240.0.1", "host": "a.example.com"},
			map[string]any{"value": "2001:2::f0f0:1", "host": "a.example.com"},
			map[string]any{"value": "240.240.0.2", "host": "B.example.com"},
		}},
		want: "a.example.com. 240.240.0.1 2001:2::f0f0:1; b.example.com. 240.240.0.2",
	},
	{
		name:   "a status address without a host is every host's",
		spec:   map[string]any{"hosts": list("a.example.com"), "resolution": "DNS"},
		status: map[string]any{"addresses": []any{map[string]any{"value": "240.240.0.9"}}},
		want:   "a.example.com. 240.240.0.9",
	},
	{
		name: "spec.addresses beat status.addresses",
		spec: map[string]any{"hosts": list("a.example.com"), "resolution": "DNS", "addresses": list("192.0.2.1")},
		status: map[string]any{"addresses": []any{
			map[string]any{"value": "240.240.0.1", "host": "a.example.com"},
		}},
		want: "a.example.com. 192.0.2.1",
	},
	{
		name: "no address: a VIP for every resolution but NONE",
		spec: map[string]any{"hosts": list("dns.example.com"), "resolution": "DNS"},
		want: "dns.example.com. VIP",
	},
	{name: "STATIC", spec: map[string]any{"hosts": list("s.example.com"), "resolution": "STATIC"}, want: "s.example.com. VIP"},
	{name: "DNS_ROUND_ROBIN", spec: map[string]any{"hosts": list("r.example.com"), "resolution": "DNS_ROUND_ROBIN"}, want: "r.example.com. VIP"},
	{name: "NONE without addresses: nothing", spec: map[string]any{"hosts": list("n.example.com"), "resolution": "NONE"}, want: ""},
	{name: "resolution unset is NONE", spec: map[string]any{"hosts": list("n.example.com")}, want: ""},
	{
		name: "NONE with addresses answers them",
		spec: map[string]any{"hosts": list("n.example.com"), "addresses": list("192.0.2.7")},
		want: "n.example.com. 192.0.2.7",
	},
	{
		name: "wildcard with addresses",
		spec: map[string]any{"hosts": list("*.wild.example.com"), "resolution": "NONE", "addresses": list("192.0.2.30")},
		want: "*.wild.example.com. 192.0.2.30",
	},
	{name: "wildcard DNS without addresses: nothing", spec: map[string]any{"hosts": list("*.wild.example.com"), "resolution": "DNS"}, want: ""},
	{name: "wildcard DYNAMIC_DNS: a VIP", spec: map[string]any{"hosts": list("*.dyn.example.com"), "resolution": "DYNAMIC_DNS"}, want: "*.dyn.example.com. VIP"},
	{
		name: "exportTo . is the entry's namespace",
		spec: map[string]any{"hosts": list("p.example.com"), "resolution": "DNS", "exportTo": list(".")},
		want: "p.example.com. VIP visible:team-a",
	},
	{
		name: "exportTo names and .",
		spec: map[string]any{"hosts": list("p.example.com"), "resolution": "DNS", "exportTo": list("team-b", ".")},
		want: "p.example.com. VIP visible:team-b,team-a",
	},
	{
		name: "exportTo * among others is everyone",
		spec: map[string]any{"hosts": list("p.example.com"), "resolution": "DNS", "exportTo": list(".", "*")},
		want: "p.example.com. VIP",
	},
	{name: "exportTo ~ is nobody", spec: map[string]any{"hosts": list("p.example.com"), "resolution": "DNS", "exportTo": list("~")}, want: ""},
	{
		name:    "a bad host is skipped, the others answered",
		spec:    map[string]any{"hosts": list("*.com", "ok.example.com", "ok.example.com"), "resolution": "DNS"},
		want:    "ok.example.com. VIP",
		wantBad: `host "*.com": "*.com": a wildcard needs a parent of at least two labels`,
	},
}

func TestEntryHosts(t *testing.T) {
	for _, tt := range entryHostsCases {
		t.Run(tt.name, func(t *testing.T) {
			o, err := transformServiceEntry(entry("team-a", tt.spec, tt.status))
			if err != nil {
				t.Fatal(err)
			}
			se := o.(*serviceEntry)
			hosts, bad := entryHosts(se)
			if got := renderHosts(hosts); got != tt.want {
				t.Errorf("hosts = %q, want %q", got, tt.want)
			}
			var badS []string
			for _, e := range bad {
				badS = append(badS, e.Error())
			}
			if got := strings.Join(badS, "; "); got != tt.wantBad {
				t.Errorf("bad = %q, want %q", got, tt.wantBad)
			}
			for _, h := range hosts {
				if h.Order() != "2025-03-04T05:06:07Z/0b6e2f1c-0000-4000-8000-000000000001" {
					t.Errorf("order = %q", h.Order())
				}
			}
		})
	}
}

// The order key sorts as creation time, whatever the time zone the server
// reports, and the UID breaks ties.
func TestEntryOrder(t *testing.T) {
	mk := func(ts time.Time, uid string) string {
		u := entry("ns", map[string]any{"hosts": list("a.example.com")}, nil)
		u.SetCreationTimestamp(metav1.NewTime(ts))
		u.SetUID(types.UID(uid))
		o, _ := transformServiceEntry(u)
		return o.(*serviceEntry).order
	}
	east := time.FixedZone("east", 5*3600)
	a := mk(time.Date(2025, 1, 1, 9, 0, 0, 0, time.UTC), "b")
	b := mk(time.Date(2025, 1, 1, 9, 0, 1, 0, east).Add(5*time.Hour), "a") // one second later, another zone
	c := mk(time.Date(2025, 1, 1, 9, 0, 1, 0, time.UTC), "b")
	if !(a < b && b < c) {
		t.Errorf("orders do not sort by time then UID: %q %q %q", a, b, c)
	}
}

func TestCRDVersion(t *testing.T) {
	mk := func(established bool, versions ...[2]any) *crd {
		var vs []any
		for _, v := range versions {
			vs = append(vs, map[string]any{"name": v[0], "served": v[1]})
		}
		u := &unstructured.Unstructured{Object: map[string]any{"spec": map[string]any{"versions": vs}}}
		if established {
			u.Object["status"] = map[string]any{"conditions": []any{map[string]any{"type": "Established", "status": "True"}}}
		}
		u.SetName(ServiceEntryCRD)
		o, _ := transformCRD(u)
		return o.(*crd)
	}
	tests := []struct {
		name string
		crd  *crd
		want string
	}{
		{"absent", nil, ""},
		{"not established", mk(false, [2]any{"v1", true}), ""},
		{"v1 first", mk(true, [2]any{"v1alpha3", true}, [2]any{"v1beta1", true}, [2]any{"v1", true}), "v1"},
		{"v1 not served", mk(true, [2]any{"v1alpha3", true}, [2]any{"v1beta1", true}, [2]any{"v1", false}), "v1beta1"},
		{"old Istio", mk(true, [2]any{"v1alpha3", true}), "v1alpha3"},
		{"unknown version", mk(true, [2]any{"v2", true}), "v2"},
		{"nothing served", mk(true, [2]any{"v1", false}), ""},
	}
	for _, tt := range tests {
		if got := tt.crd.version(); got != tt.want {
			t.Errorf("%s: version = %q, want %q", tt.name, got, tt.want)
		}
	}
}
