package talkers

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// names: cgroup i is pod wl-i of namespace ns-(i%nsCount); cgroup 0 keys by address are unknown.
func fakeNamer(nsCount int) func(workload.Key) workload.Identity {
	return func(k workload.Key) workload.Identity {
		if k.Cgroup == 0 {
			return workload.Identity{Workload: workload.Unknown}
		}
		ns := fmt.Sprintf("ns-%d", k.Cgroup%uint64(nsCount))
		pod := fmt.Sprintf("wl-%d", k.Cgroup)
		return workload.Identity{Workload: ns + "/" + pod, Namespace: ns, Pod: pod}
	}
}

type series map[string]float64 // "name{labels}" -> value

func gather(t *testing.T, c prometheus.Collector) series {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := series{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			out[mf.GetName()+"{"+strings.Join(ls, ",")+"}"] = value(m)
		}
	}
	return out
}

func value(m *dto.Metric) float64 {
	if m.GetGauge() != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetCounter().GetValue()
}

// The top K of each count are exact, "(other)" holds the rest, and the
// series count does not grow with the number of workloads.
func TestTopKBoundedAndExact(t *testing.T) {
	for _, workloads := range []int{10, 1000} {
		t.Run(fmt.Sprint(workloads), func(t *testing.T) {
			const k, nsLimit = 10, 5
			tr, err := New(Config{K: k, Window: time.Minute, Period: 5 * time.Second, Namespaces: true, NamespaceLimit: nsLimit, Name: fakeNamer(20)})
			if err != nil {
				t.Fatal(err)
			}
			c := tr.Counter()
			var total, nxTotal uint64
			for i := 1; i <= workloads; i++ {
				// workload i sends i queries, i/2 of them answered NXDOMAIN; every 7th one went unanswered
				for q := range i {
					c.Count(workload.Key{Cgroup: uint64(i)}, q < i/2, q%7 == 0)
					total++
					if q < i/2 {
						nxTotal++
					}
				}
			}
			c.Count(workload.Key{}, false, false) // an unknown sender
			total++
			tr.Move() // the counts are in the table out of use now
			tr.Move() // ... and read into the window
			s := gather(t, tr)
			fixed := 1                               // window seconds
			bound := 3*(k+1) + fixed + 2*(nsLimit+3) // K + other per ranking; namespaces up to the cap plus (other), (none), (unknown)
			if len(s) > bound {
				t.Errorf("%d series for %d workloads, bound %d: %v", len(s), workloads, bound, s)
			}
			var sumQ float64
			for name, v := range s {
				if strings.HasPrefix(name, "meshdns_top_workload_queries{") {
					sumQ += v
				}
			}
			if sumQ != float64(total) {
				t.Errorf("top queries + other = %v, want %d", sumQ, total)
			}
			top := workloads // the biggest sender
			key := fmt.Sprintf("meshdns_top_workload_queries{client_namespace=ns-%d,client_pod=wl-%d,workload=ns-%d/wl-%d}", top%20, top, top%20, top)
			if s[key] != float64(top) {
				t.Errorf("%s = %v, want %d", key, s[key], top)
			}
			var nsQ, nsNX float64
			for name, v := range s {
				if strings.HasPrefix(name, "meshdns_namespace_queries_total{") {
					nsQ += v
				}
				if strings.HasPrefix(name, "meshdns_namespace_nxdomain_total{") {
					nsNX += v
				}
			}
			if nsQ != float64(total) || nsNX != float64(nxTotal) {
				t.Errorf("namespace counters: %v queries, %v nxdomain, want %d, %d", nsQ, nsNX, total, nxTotal)
			}
			if s["meshdns_top_workload_window_seconds{}"] != 10 {
				t.Errorf("window seconds = %v after two periods", s["meshdns_top_workload_window_seconds{}"])
			}
			// Twelve more moves and the counts leave the one-minute window.
			for range 12 {
				tr.Move()
			}
			s = gather(t, tr)
			if v := s["meshdns_top_workload_queries{client_namespace=,client_pod=,workload=(other)}"]; v != 0 || len(s) > bound {
				t.Errorf("after the window: other = %v, %d series", v, len(s))
			}
		})
	}
}

// Counting allocates nothing.
func TestCountAllocatesNothing(t *testing.T) {
	tr, err := New(Config{Name: fakeNamer(1)})
	if err != nil {
		t.Fatal(err)
	}
	c := tr.Counter()
	k := workload.Key{Cgroup: 5, PID: 9}
	if n := testing.AllocsPerRun(1000, func() { c.Count(k, true, false) }); n != 0 {
		t.Errorf("%v allocations per count", n)
	}
}
