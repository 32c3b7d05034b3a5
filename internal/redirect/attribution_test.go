package redirect

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// sourceOf is the source address and port of the query for name that r saw.
func sourceOf(t *testing.T, r *testenv.FakeDNS, name string) (netip.AddrPort, bool) {
	t.Helper()
	for _, q := range r.Queries() {
		if q.Name == name+"." {
			return q.Source, q.Proto == "tcp"
		}
	}
	t.Fatalf("the resolver %s saw no query for %s", r.Addr, name)
	return netip.AddrPort{}, false
}

// attributionKinds are the ways clients send, each to a nameserver whose
// resolver (family, slot) sees the query.
func attributionKinds() []struct {
	name      string
	args      []string
	fam, slot int
} {
	m1 := mapped(ns1)
	return []struct {
		name      string
		args      []string
		fam, slot int
	}{
		{"glibc-style connected udp", []string{"-mode=connect", "-dst=" + hp(ns1, 53)}, 4, 0},
		{"go dial", []string{"-mode=godial", "-dst=" + hp(ns2, 53)}, 4, 1},
		{"musl-style unconnected sendto", []string{"-mode=sendto", "-dst=" + hp(ns1, 53)}, 4, 0},
		{"tcp", []string{"-mode=tcp", "-dst=" + hp(ns1, 53)}, 4, 0},
		{"v6 socket, v4-mapped sendto", []string{"-mode=sendto", "-family=6", "-dst=" + hp(m1, 53)}, 4, 0},
		{"v6 socket, v4-mapped connected", []string{"-mode=connect", "-family=6", "-dst=" + hp(m1, 53)}, 4, 0},
		{"v6 socket, v4-mapped tcp", []string{"-mode=tcp", "-family=6", "-dst=" + hp(m1, 53)}, 4, 0},
		{"v6 nameserver sendto", []string{"-mode=sendto", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2},
		{"v6 nameserver tcp", []string{"-mode=tcp", "-family=6", "-dst=" + hp(ns6, 53)}, 6, 2},
	}
}

// The attribute program records who sent each redirected query (cgroup and
// process), keyed by what the resolver sees (source address, port, protocol):
// two cgroups in one network namespace, every kind of client. The entry of a
// closed socket is marked free but still answers.
func TestAttributionRecordsSender(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	cfg.Attribution = true
	d := n.start(t, cfg)
	cgs := []*testenv.Cgroup{n.cg.Child(t, "wl-a"), n.cg.Child(t, "wl-b")}
	before, err := ReadStats(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	sent := 0
	for i, cg := range cgs {
		for j, k := range attributionKinds() {
			t.Run(fmt.Sprintf("%s/%s", cg.Path[len(n.cg.Path)+1:], k.name), func(t *testing.T) {
				name := fmt.Sprintf("q%d-%d.attr.test", i, j)
				rs, pid := n.queryPID(t, proc{uid: userUID, cg: cg}, append(k.args, "-name="+name)...)
				if len(rs) != 1 || rs[0].Err != "" {
					t.Fatalf("client: %+v", rs)
				}
				sent++
				src, tcp := sourceOf(t, n.resolver(k.fam, k.slot), name)
				s, ok := d.Flows().Lookup(src, tcp)
				if !ok {
					t.Fatalf("no sender recorded for %s (tcp %v)", src, tcp)
				}
				if want := cg.ID(t); s.Cgroup != want || s.PID != uint32(pid) {
					t.Errorf("sender of %s = cgroup %d pid %d, want cgroup %d (%s) pid %d", src, s.Cgroup, s.PID, want, cg.Path, pid)
				}
				if _, ok := d.Flows().Lookup(netip.AddrPortFrom(src.Addr(), src.Port()+1), tcp); ok {
					t.Errorf("a sender is recorded for %s:%d, which sent nothing", src.Addr(), src.Port()+1)
				}
			})
		}
	}
	after, err := ReadStats(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	recorded := counterOf(t, after, "attribute", "flow_recorded") - counterOf(t, before, "attribute", "flow_recorded")
	released := counterOf(t, after, "sock_release", "flow_released") - counterOf(t, before, "sock_release", "flow_released")
	if recorded < uint64(sent) || released < uint64(sent) {
		t.Errorf("flow_recorded +%d, flow_released +%d, want at least %d each (one per client socket)", recorded, released, sent)
	}
	if ev := counterOf(t, after, "attribute", "flow_evicted"); ev != 0 {
		t.Errorf("flow_evicted = %d with a handful of flows", ev)
	}
}

// Without Config.Attribution the attribute program records nothing.
func TestAttributionOff(t *testing.T) {
	n := newTestNet(t)
	d := n.start(t, n.config())
	rs := n.query(t, proc{uid: userUID}, "-mode=connect", "-dst="+hp(ns1, 53), "-name=off.attr.test")
	if len(rs) != 1 || rs[0].Err != "" {
		t.Fatalf("client: %+v", rs)
	}
	src, _ := sourceOf(t, n.resolver(4, 0), "off.attr.test")
	if s, ok := d.Flows().Lookup(src, false); ok {
		t.Errorf("sender %+v recorded for %s with attribution off", s, src)
	}
	if got := hookCounter(t, n.pinDir(), "attribute", "flow_recorded"); got != 0 {
		t.Errorf("flow_recorded = %d with attribution off", got)
	}
}
