package egress

import (
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

var enforce = Rule{Enforce: true, FailClosed: true}

// A selected cgroup connects and sends only where a live grant allows
// (address, and port and protocol when the grant names them) or to an
// internal prefix; everything else is refused with EPERM and recorded. A
// container cgroup created inside the selected one afterwards is covered; a
// cgroup without a workload is untouched.
func TestEnforce(t *testing.T) {
	e := newEnv(t, envOpts{})
	pod := e.workload(t, "pod", 1, enforce)
	other := e.cg.Child(t, "other")
	if err := e.eg.SetInternal([]netip.Prefix{internal}); err != nil {
		t.Fatal(err)
	}
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	g := e.eg.Grants()
	if err := g.Grant(1, "any.test", []netip.Addr{inet1, inet6}, nil, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := g.Grant(1, "web.test", []netip.Addr{inet2}, []Port{{Port: port, Proto: ProtoTCP}}, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		dst("tcp", inet1, port): "ok", dst("udpc", inet1, port): "ok", dst("udp", inet1, otherPort): "ok",
		dst("tcp", inet6, port): "ok", dst("udp", inet6, port): "ok", dst("udpc", inet6, otherPort): "ok",
		dst("tcp", inet2, port): "ok", dst("tcp", inet2, otherPort): "EPERM", dst("udpc", inet2, port): "EPERM",
		dst("tcp", inet3, port): "EPERM", dst("udp", inet3, port): "EPERM", dst("udpc", inet3, port): "EPERM",
		dst("tcp", inet6b, port): "EPERM", dst("udp", inet6b, port): "EPERM",
		dst("tcp", inetInt, port): "ok", dst("udp", inetInt, port): "ok",
	}
	// v4-mapped destinations on v6 sockets are their v4 address.
	want[dst("tcp", netip.AddrFrom16(inet3.As16()), port)] = "EPERM"
	want[dst("tcp", netip.AddrFrom16(inet1.As16()), port)] = "ok"
	e.want(t, pod, want)
	c := e.counts(t, 1)
	if c.Denied != 8 || c.AllowedGrant != 8 || c.AllowedInternal != 2 || c.Audited != 0 {
		t.Errorf("counts %+v, want 8 denied, 8 allowed by grant, 2 internal", c)
	}
	ctr := pod.Child(t, "ctr") // created after SetWorkload
	e.want(t, ctr, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "EPERM"})
	e.want(t, other, map[string]string{dst("tcp", inet3, port): "ok", dst("udp", inet6b, port): "ok"})
	if got := e.counts(t, 1); got.Denied != 9 || got.AllowedGrant != 9 {
		t.Errorf("after the container's connects: %+v", got)
	}
	seen := map[netip.AddrPort]Event{}
	for range 9 {
		ev := e.nextEvent(t)
		seen[ev.Dst] = ev
		if ev.Workload != 1 || ev.Verdict != Denied {
			t.Errorf("event %+v: want workload 1, denied", ev)
		}
	}
	ev, ok := seen[netip.AddrPortFrom(inet3, port)]
	if !ok || ev.Cgroup != ctr.ID(t) && ev.Cgroup != pod.ID(t) || time.Since(ev.Time) > time.Minute || ev.Time.After(time.Now()) {
		t.Errorf("event of %s: %+v (pod cgroup %d)", inet3, ev, pod.ID(t))
	}
	if _, ok := seen[netip.AddrPortFrom(inet6b, port)]; !ok {
		t.Errorf("no event for %s; saw %v", inet6b, seen)
	}
	if e.eg.EventsLost() != 0 {
		t.Errorf("%d events lost", e.eg.EventsLost())
	}
}

// Audit mode allows everything and records what no grant allowed.
func TestAudit(t *testing.T) {
	e := newEnv(t, envOpts{})
	pod := e.workload(t, "pod", 2, Rule{})
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	if err := e.eg.Grants().Grant(2, "a.test", []netip.Addr{inet1}, nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "ok", dst("udp", inet6b, port): "ok"})
	c := e.counts(t, 2)
	if c.Audited != 2 || c.AllowedGrant != 1 || c.Denied != 0 {
		t.Errorf("counts %+v, want 2 audited, 1 allowed by grant", c)
	}
	for range 2 {
		if ev := e.nextEvent(t); ev.Verdict != Audited || ev.Workload != 2 {
			t.Errorf("event %+v, want audited of workload 2", ev)
		}
	}
}

// With internal destinations in scope, an internal prefix needs a grant too.
// Egress switched off, nothing is enforced.
func TestInternalInScopeAndOff(t *testing.T) {
	e := newEnv(t, envOpts{})
	in := e.workload(t, "in", 3, Rule{Enforce: true, FailClosed: true, InternalInScope: true})
	out := e.workload(t, "out", 4, enforce)
	if err := e.eg.SetInternal([]netip.Prefix{internal, netip.MustParsePrefix("2001:2::2/128")}); err != nil {
		t.Fatal(err)
	}
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	e.want(t, in, map[string]string{dst("tcp", inetInt, port): "EPERM", dst("tcp", inet6b, port): "EPERM"})
	e.want(t, out, map[string]string{dst("tcp", inetInt, port): "ok", dst("tcp", inet6b, port): "ok", dst("tcp", inet3, port): "EPERM"})
	if err := e.eg.SetInternal(nil); err != nil {
		t.Fatal(err)
	}
	e.want(t, out, map[string]string{dst("tcp", inetInt, port): "EPERM"})
	if err := e.eg.Enable(false); err != nil {
		t.Fatal(err)
	}
	e.want(t, in, map[string]string{dst("tcp", inetInt, port): "ok", dst("tcp", inet3, port): "ok"})
	if c := e.counts(t, 3); c.Denied != 2 {
		t.Errorf("counts with egress off %+v: still 2 denied from before", c)
	}
}

// An expired grant no longer allows; granting again does.
func TestExpiredGrantDenied(t *testing.T) {
	e := newEnv(t, envOpts{})
	pod := e.workload(t, "pod", 5, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	g := e.eg.Grants()
	g.mu.Lock()
	g.now = func() int64 { return monotonicNow() - int64(time.Minute) } // this grant expired 55 s ago
	g.mu.Unlock()
	if err := g.Grant(5, "old.test", []netip.Addr{inet1}, nil, 0); err != nil {
		t.Fatal(err)
	}
	g.mu.Lock()
	g.now = monotonicNow
	g.mu.Unlock()
	e.want(t, pod, map[string]string{dst("tcp", inet1, port): "EPERM"})
	if err := g.Grant(5, "old.test", []netip.Addr{inet1}, nil, 0); err != nil { // the grace alone: 5 s
		t.Fatal(err)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet1, port): "ok"})
}

// While no agent serves (its resolver sockets closed), a fail-closed workload
// keeps enforcing (its live grants still allow) and a fail-open one is let
// through, counted.
func TestFailModes(t *testing.T) {
	e := newEnv(t, envOpts{})
	open := e.workload(t, "open", 10, Rule{Enforce: true})
	closed := e.workload(t, "closed", 11, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	for _, wl := range []WorkloadID{10, 11} {
		if err := e.eg.Grants().Grant(wl, "a.test", []netip.Addr{inet1}, nil, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	e.want(t, open, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "EPERM"})
	e.want(t, closed, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "EPERM"})
	e.resolverGone = true
	e.resolver.Close() // the agent's sockets are gone
	e.want(t, open, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "ok", dst("udp", inet6b, port): "ok"})
	e.want(t, closed, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "EPERM", dst("udp", inet6b, port): "EPERM"})
	if c := e.counts(t, 10); c.FailOpen != 2 || c.Denied != 1 {
		t.Errorf("fail-open workload: %+v, want 2 fail_open, 1 denied", c)
	}
	if c := e.counts(t, 11); c.FailOpen != 0 || c.Denied != 3 || c.AllowedGrant != 2 {
		t.Errorf("fail-closed workload: %+v, want 3 denied, 2 allowed by grant", c)
	}
}

// Grants, workloads and the switch are pinned: while the datapath is closed
// (the agent stopped, its programs left attached) they keep enforcing, and a
// new datapath and Egress adopt them.
func TestGrantsSurviveRestart(t *testing.T) {
	e := newEnv(t, envOpts{persist: true})
	pod := e.workload(t, "pod", 20, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	if err := e.eg.Grants().Grant(20, "a.test", []netip.Addr{inet1, inet6}, nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := e.eg.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.dp.Close(); err != nil {
		t.Fatal(err)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet6, port): "ok", dst("tcp", inet3, port): "EPERM"})

	e.startDatapath(t, true)
	e.serve(t)
	e.startEgress(t, Config{})
	if total, mine := e.eg.Grants().Len(20); total != 2 || mine != 2 {
		t.Errorf("adopted %d grants, %d of workload 20; want 2, 2", total, mine)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "EPERM"})
	if err := e.eg.Grants().Grant(20, "b.test", []netip.Addr{inet3}, nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet3, port): "ok"})
	if got := e.eg.Workloads(); len(got) != 1 || got[pod.ID(t)] != 20 {
		t.Errorf("adopted workloads %v, want cgroup %d as 20", got, pod.ID(t))
	}
	// RemoveWorkload knows the adopted workload: its cgroup is no longer enforced.
	if err := e.eg.RemoveWorkload(pod.ID(t)); err != nil {
		t.Fatal(err)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet2, port): "ok"})
	if total, _ := e.eg.Grants().Len(20); total != 0 {
		t.Errorf("%d grants left after the workload went", total)
	}
}

// One workload's flood of distinct grants stays within its quota and never
// evicts another workload's grants; the map never holds more than its cap.
func TestGrantQuotaInKernel(t *testing.T) {
	e := newEnv(t, envOpts{grants: 64, egress: Config{Quota: 40}})
	a := e.workload(t, "a", 30, enforce)
	e.workload(t, "b", 31, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	g := e.eg.Grants()
	if err := g.Grant(30, "a.test", []netip.Addr{inet1, inet2}, nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		a := netip.AddrFrom4([4]byte{198, 18, byte(1 + i/250), byte(i % 250)})
		if err := g.Grant(31, "flood.test", []netip.Addr{a}, nil, time.Minute); err != nil {
			t.Fatalf("flood grant %d: %v", i, err)
		}
	}
	perWL := map[uint32]int{}
	var (
		kk redirect.EgressGrantKey
		v  redirect.EgressGrant
	)
	it := e.dp.Egress().Grants.Iterate()
	n := 0
	for it.Next(&kk, &v) {
		perWL[kk.Workload]++
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if n > 64 || perWL[30] != 2 || perWL[31] != 40 {
		t.Errorf("grant map holds %d (%v), want workload 30's 2 and workload 31's quota of 40", n, perWL)
	}
	e.want(t, a, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet2, port): "ok"})
}

// A handover: a successor's datapath and Egress start on the same pins while
// the predecessor runs (its resolver socket still registered and shared),
// adopt its grants and workloads, and the predecessor hands off and closes:
// enforcement and grants go on without a gap, and the successor's new grants
// allow.
func TestGrantsPassOnHandover(t *testing.T) {
	e := newEnv(t, envOpts{persist: true})
	pod := e.workload(t, "pod", 40, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	if err := e.eg.Grants().Grant(40, "a.test", []netip.Addr{inet1}, nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	old, oldEg := e.dp, e.eg
	e.startDatapath(t, true) // the successor (removes everything at the end)
	e.serve(t)
	e.startEgress(t, Config{})
	old.Handoff()
	if err := oldEg.Close(); err != nil {
		t.Fatal(err)
	}
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	if total, mine := e.eg.Grants().Len(40); total != 1 || mine != 1 {
		t.Errorf("the successor adopted %d grants, %d of workload 40; want 1, 1", total, mine)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet1, port): "ok", dst("tcp", inet3, port): "EPERM"})
	if err := e.eg.Grants().Grant(40, "b.test", []netip.Addr{inet3}, nil, time.Minute); err != nil {
		t.Fatal(err)
	}
	e.want(t, pod, map[string]string{dst("tcp", inet3, port): "ok", dst("tcp", inet2, port): "EPERM"})
	if c := e.counts(t, 40); c.Denied != 2 || c.AllowedGrant != 2 {
		t.Errorf("counts across the handover %+v, want 2 denied, 2 allowed by grant", c)
	}
}

// A resolver that stops reading (frozen: the DNS capture's stalled verdict)
// counts as no agent: a fail-open workload is let through while it is seen
// stalled, a fail-closed one is not; once it reads again, both enforce.
func TestFailOpenWhileResolverStalled(t *testing.T) {
	e := newEnv(t, envOpts{})
	open := e.workload(t, "open", 50, Rule{Enforce: true})
	closed := e.workload(t, "closed", 51, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	stalled := func() bool {
		st, err := redirect.ReadStatus(filepath.Join(e.bpffs, "meshdns"))
		return err == nil && st.Stalled
	}
	if !testenv.WaitFor(5*time.Second, func() bool {
		st, err := redirect.ReadStatus(filepath.Join(e.bpffs, "meshdns"))
		return err == nil && st.WatchClock
	}) {
		testenv.Skip(t, "no watch clock (BPF timers, Linux 5.15): nothing looks at an idle frozen resolver")
	}
	e.want(t, open, map[string]string{dst("tcp", inet3, port): "EPERM"})
	thaw := e.resolver.Freeze()
	defer thaw()
	testenv.Eventually(t, 5*time.Second, stalled, "the frozen resolver is not seen stalled")
	e.want(t, open, map[string]string{dst("tcp", inet3, port): "ok"})
	e.want(t, closed, map[string]string{dst("tcp", inet3, port): "EPERM"})
	thaw()
	testenv.Eventually(t, 5*time.Second, func() bool { return !stalled() }, "the thawed resolver is still seen stalled")
	e.want(t, open, map[string]string{dst("tcp", inet3, port): "EPERM"})
	if c := e.counts(t, 50); c.FailOpen != 1 || c.Denied != 2 {
		t.Errorf("fail-open workload: %+v, want 1 fail_open, 2 denied", c)
	}
}

// A fail-open workload whose DNS query went around the agent (no resolver
// sockets: the query reached its original nameserver, and no grant covers the
// answer) may still connect once the agent serves again, for a while: the
// connect that follows such a lookup is not denied at the agent's return. A
// fail-closed workload gets no such allowance.
func TestFailOpenLookupCoversTheConnectAfterTheAgentReturns(t *testing.T) {
	e := newEnv(t, envOpts{})
	open := e.workload(t, "open", 12, Rule{Enforce: true})
	closed := e.workload(t, "closed", 13, enforce)
	if err := e.eg.Enable(true); err != nil {
		t.Fatal(err)
	}
	e.want(t, open, map[string]string{dst("tcp", inet3, port): "EPERM"})
	if err := e.dp.Unserve(); err != nil { // the agent is away
		t.Fatal(err)
	}
	// Each workload's lookup goes to the original nameserver.
	e.want(t, open, map[string]string{dst("udp", ns1, 53): "ok"})
	e.want(t, closed, map[string]string{dst("udp", ns1, 53): "ok"})
	e.serve(t) // the agent is back
	e.want(t, open, map[string]string{dst("tcp", inet3, port): "ok"})
	e.want(t, closed, map[string]string{dst("tcp", inet3, port): "EPERM"})
	if c := e.counts(t, 12); c.FailOpen != 1 || c.Denied != 1 {
		t.Errorf("fail-open workload: %+v, want 1 fail_open (after its lookup went around the agent), 1 denied (before)", c)
	}
}
