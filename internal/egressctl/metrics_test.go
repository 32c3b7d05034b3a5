package egressctl

import (
	"encoding/json"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

type fakeCounter map[egress.WorkloadID]egress.Counts

func (f fakeCounter) Counts() (map[egress.WorkloadID]egress.Counts, error) { return f, nil }
func (f fakeCounter) EventsLost() uint64                                   { return 3 }

// TestCollectorBoundsWorkloadSeries: the busiest workloads get series of their
// own, the rest (and workloads no longer selected) are summed into (other), and
// Grant's results are counted.
func TestCollectorBoundsWorkloadSeries(t *testing.T) {
	root, _ := cgroupTree(t, podA, podB)
	fake := newFake()
	c := syncedController(t, fake, Config{CgroupRoot: root, Pods: func() []Pod {
		return []Pod{{Namespace: "ns", Name: "a", UID: "11111111-1111-1111-1111-111111111111"},
			{Namespace: "ns", Name: "b", UID: "22222222-2222-2222-2222-222222222222"}}
	}}, egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "ns/all", Namespace: "ns",
		Egress: []egresspolicy.Rule{{Names: []string{"ok.test"}}}})
	ids := map[string]egress.WorkloadID{}
	for _, s := range c.Selected() {
		ids[s.Workload] = s.ID
	}
	counts := fakeCounter{
		ids["ns/a"]: {AllowedGrant: 10, Denied: 5},
		ids["ns/b"]: {Denied: 2},
		999:         {Denied: 1, Audited: 4}, // no longer selected
	}
	addr := []netip.Addr{netip.MustParseAddr("198.18.0.9")}
	c.Grant(uint32(ids["ns/a"]), "ok.test.", addr, time.Second)  //nolint:errcheck // the fake does not fail
	c.Grant(uint32(ids["ns/a"]), "bad.test.", addr, time.Second) //nolint:errcheck

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewCollector(c, counts, 1))
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"meshdns_egress_connects_total", []string{"verdict", "granted", "workload", "ns/a", "client_namespace", "ns", "client_pod", "a"}, 10},
		{"meshdns_egress_connects_total", []string{"verdict", "denied", "workload", "ns/a", "client_namespace", "ns", "client_pod", "a"}, 5},
		{"meshdns_egress_connects_total", []string{"verdict", "denied", "workload", Other, "client_namespace", "", "client_pod", ""}, 3},
		{"meshdns_egress_connects_total", []string{"verdict", "audited", "workload", Other, "client_namespace", "", "client_pod", ""}, 4},
		{"meshdns_egress_selected_workloads", nil, 2},
		{"meshdns_egress_grants_total", []string{"result", "granted"}, 1},
		{"meshdns_egress_grants_total", []string{"result", "not_allowed"}, 1},
		{"meshdns_egress_events_lost_total", nil, 3},
	} {
		if got := metrictest.Value(t, reg, tc.name, tc.labels...); got != tc.want {
			t.Errorf("%s%v = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "meshdns_egress_connects_total" && len(mf.GetMetric()) != 2*5 {
			t.Errorf("%d connect series, want 10 (the top workload and (other), 5 verdicts each)", len(mf.GetMetric()))
		}
	}
}

type fakeGrants struct{}

func (fakeGrants) Len(wl egress.WorkloadID) (int, int) { return 12, int(wl) }
func (fakeGrants) Limits() (int, int)                  { return 65536, 4096 }

// TestStatusTable: status lists each selected workload with its policy, modes,
// grants and decisions under upper-case headers, and its JSON round-trips.
func TestStatusTable(t *testing.T) {
	root, _ := cgroupTree(t, podA)
	fake := newFake()
	c := syncedController(t, fake, Config{CgroupRoot: root, Pods: onePod("shop", "web")},
		egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "shop/web", Namespace: "shop",
			FailMode: egresspolicy.FailClosed, Egress: []egresspolicy.Rule{{Names: []string{"ok.test"}}}})
	id := c.Selected()[0].ID
	st := c.Status(fakeCounter{id: {AllowedGrant: 7, Denied: 2}}, fakeGrants{})
	var b strings.Builder
	if err := st.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"egress: 1 workloads selected, 12 grants (cap 65536, 4096 per workload)",
		"WORKLOAD", "FAIL MODE", "shop/web", "DNSEgressPolicy shop/web", "enforce", "fail-closed"} {
		if !strings.Contains(out, want) {
			t.Errorf("status table lacks %q:\n%s", want, out)
		}
	}
	js, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var back Status
	if err := json.Unmarshal(js, &back); err != nil || len(back.Workloads) != 1 || back.Workloads[0].Counts.Denied != 2 || back.Workloads[0].Grants != int(id) {
		t.Errorf("status JSON %s round-trips to %+v (%v)", js, back, err)
	}
}
