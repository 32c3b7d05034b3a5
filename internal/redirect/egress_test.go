package redirect

import (
	"fmt"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// A DNS query sent from inside a selected egress workload (here from a
// container cgroup below the selected pod cgroup) is still captured, and its
// flows entry names the workload, so the resolver knows whose answer it
// grants; a query from elsewhere names none, and so does every query while
// egress is off.
func TestEgressWorkloadOfQuery(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	cfg.Attribution = true
	d := n.start(t, cfg)
	m := d.Egress()
	if m == nil {
		t.Fatal("no egress maps on a started datapath")
	}
	pod := n.cg.Child(t, "pod")
	ctr := pod.Child(t, "ctr")
	other := n.cg.Child(t, "other")
	id := pod.ID(t)
	if err := m.Workloads.Put(&id, &EgressRule{Workload: 7, Flags: EgressEnforce | EgressFailClosed}); err != nil {
		t.Fatal(err)
	}
	for _, on := range []bool{false, true} {
		if err := m.SetEnabled(on); err != nil {
			t.Fatal(err)
		}
		for ci, c := range []struct {
			cg   *testenv.Cgroup
			want uint32
		}{{ctr, 7}, {other, 0}} {
			if !on {
				c.want = 0
			}
			for j, k := range attributionKinds() {
				name := fmt.Sprintf("q%d-%v-%d.egress.test", ci, on, j)
				rs := n.query(t, proc{uid: userUID, cg: c.cg}, append(k.args, "-name="+name)...)
				if len(rs) != 1 || rs[0].Err != "" {
					t.Fatalf("%s from %s (egress %v): %+v", k.name, c.cg.Path, on, rs)
				}
				src, tcp := sourceOf(t, n.resolver(k.fam, k.slot), name) // captured: the resolver saw it
				s, ok := d.Flows().Lookup(src, tcp)
				if !ok || s.Workload != c.want || s.Cgroup != c.cg.ID(t) {
					t.Errorf("%s from %s (egress %v): sender %+v %v, want workload %d", k.name, c.cg.Path, on, s, ok, c.want)
				}
			}
		}
	}
}
