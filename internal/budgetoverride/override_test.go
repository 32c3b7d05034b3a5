package budgetoverride

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

var def = resolver.BudgetLimits{QPS: 50, Burst: 100, InFlight: 20}

func TestResolve(t *testing.T) {
	for _, tc := range []struct {
		name       string
		pod, ns    map[string]string
		want       resolver.BudgetLimits
		overridden bool
		badPod     bool
	}{
		{name: "no annotations: the flags", want: def},
		{name: "other annotations only", pod: map[string]string{"meshdns.io/other": "x", "app": "web"}, want: def},
		{name: "pod sets all", pod: map[string]string{AnnotationQPS: "500", AnnotationBurst: "1000", AnnotationInFlight: "64"},
			want: resolver.BudgetLimits{QPS: 500, Burst: 1000, InFlight: 64}, overridden: true},
		{name: "pod sets the rate: its burst is one second of it, the rest the flags'", pod: map[string]string{AnnotationQPS: "2.5"},
			want: resolver.BudgetLimits{QPS: 2.5, Burst: 0, InFlight: 20}, overridden: true},
		{name: "pod sets the in-flight cap only", pod: map[string]string{AnnotationInFlight: "0"},
			want: resolver.BudgetLimits{QPS: 50, Burst: 100, InFlight: 0}, overridden: true},
		{name: "namespace applies to a pod without any", ns: map[string]string{AnnotationQPS: "10", AnnotationBurst: "5"},
			want: resolver.BudgetLimits{QPS: 10, Burst: 5, InFlight: 20}, overridden: true},
		{name: "the pod's wins over the namespace's, whole", pod: map[string]string{AnnotationBurst: "7"}, ns: map[string]string{AnnotationQPS: "10", AnnotationInFlight: "3"},
			want: resolver.BudgetLimits{QPS: 50, Burst: 7, InFlight: 20}, overridden: true},
		{name: "a bad pod value: none of the pod's, the namespace's", pod: map[string]string{AnnotationQPS: "1000", AnnotationBurst: "lots"}, ns: map[string]string{AnnotationQPS: "10"},
			want: resolver.BudgetLimits{QPS: 10, Burst: 0, InFlight: 20}, overridden: true, badPod: true},
		{name: "a bad pod value, no namespace's: the flags", pod: map[string]string{AnnotationQPS: "-1", AnnotationInFlight: "9"},
			want: def, badPod: true},
		{name: "not a finite rate", pod: map[string]string{AnnotationQPS: "Inf"}, want: def, badPod: true},
		{name: "NaN rate", pod: map[string]string{AnnotationQPS: "NaN"}, want: def, badPod: true},
		{name: "a fractional burst", pod: map[string]string{AnnotationBurst: "1.5"}, want: def, badPod: true},
		{name: "a misspelt annotation", pod: map[string]string{"meshdns.io/upstream-qsp": "10"}, want: def, badPod: true},
		{name: "spaces around a value", pod: map[string]string{AnnotationQPS: " 20 "},
			want: resolver.BudgetLimits{QPS: 20, InFlight: 20}, overridden: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod, err := Parse(tc.pod)
			if (err != nil) != tc.badPod {
				t.Fatalf("Parse(%v) error %v, want error %v", tc.pod, err, tc.badPod)
			}
			if err != nil && pod.Set() {
				t.Errorf("Parse(%v) failed but returned a set override %+v", tc.pod, pod)
			}
			ns, err := Parse(tc.ns)
			if err != nil {
				t.Fatal(err)
			}
			got, ok := Resolve(def, pod, ns)
			if got != tc.want || ok != tc.overridden {
				t.Errorf("Resolve = %+v, %v; want %+v, %v", got, ok, tc.want, tc.overridden)
			}
		})
	}
}

type fakeObjects struct{ pods, namespaces map[string]map[string]string }

func (f fakeObjects) PodAnnotations(ns, name string) map[string]string { return f.pods[ns+"/"+name] }
func (f fakeObjects) NamespaceAnnotations(name string) map[string]string {
	return f.namespaces[name]
}

type fakeNamer map[uint64]workload.Identity

func (f fakeNamer) Known(k workload.Key) (workload.Identity, bool) {
	id, ok := f[k.Cgroup]
	return id, ok
}

// The source names the workload, finds its pod's or namespace's override,
// and reports a bad annotation once per object and value.
func TestSourceLimitsFor(t *testing.T) {
	objs := fakeObjects{
		pods: map[string]map[string]string{
			"team-a/api-0": {AnnotationQPS: "500"},
			"team-a/bad-0": {AnnotationQPS: "fast"},
		},
		namespaces: map[string]map[string]string{"team-a": {AnnotationQPS: "5"}},
	}
	namer := fakeNamer{
		1: {Namespace: "team-a", Pod: "api-0"},
		2: {Namespace: "team-a", Pod: "web-0"},
		3: {Namespace: "team-a", Pod: "bad-0"},
		4: {Workload: "/system.slice/vm.service"},
	}
	var log bytes.Buffer
	s := New(def, objs, namer, slog.New(slog.NewTextHandler(&log, nil)))
	reg := prometheus.NewRegistry()
	reg.MustRegister(s)
	for _, tc := range []struct {
		cgroup uint64
		want   resolver.BudgetLimits
		ok     bool
	}{
		{1, resolver.BudgetLimits{QPS: 500, InFlight: 20}, true},
		{2, resolver.BudgetLimits{QPS: 5, InFlight: 20}, true},
		{3, resolver.BudgetLimits{QPS: 5, InFlight: 20}, true},
		{3, resolver.BudgetLimits{QPS: 5, InFlight: 20}, true},
		{4, resolver.BudgetLimits{}, false},
		{5, resolver.BudgetLimits{}, false}, // not named yet
	} {
		got, ok := s.LimitsFor(workload.Key{Cgroup: tc.cgroup})
		if got != tc.want || ok != tc.ok {
			t.Errorf("LimitsFor(cgroup %d) = %+v, %v; want %+v, %v", tc.cgroup, got, ok, tc.want, tc.ok)
		}
	}
	if n := strings.Count(log.String(), "bad upstream budget annotation"); n != 1 || !strings.Contains(log.String(), "team-a/bad-0") {
		t.Errorf("log has %d warnings, want one naming team-a/bad-0:\n%s", n, log.String())
	}
	if got := metrictest.Value(t, reg, "meshdns_budget_override_errors_total", "kind", "pod"); got != 1 {
		t.Errorf("meshdns_budget_override_errors_total{kind=pod} = %v, want 1", got)
	}
	// A new bad value of the same object is reported again.
	objs.pods["team-a/bad-0"] = map[string]string{AnnotationQPS: "-3"}
	s.LimitsFor(workload.Key{Cgroup: 3})
	if got := metrictest.Value(t, reg, "meshdns_budget_override_errors_total", "kind", "pod"); got != 2 {
		t.Errorf("after a new bad value: meshdns_budget_override_errors_total{kind=pod} = %v, want 2", got)
	}
}
