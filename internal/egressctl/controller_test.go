package egressctl

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// fakeDatapath records what the controller writes.
type fakeDatapath struct {
	mu        sync.Mutex
	enabled   bool
	workloads map[uint64]workloadEntry
	internal  []netip.Prefix
	grants    []grantCall
	failSet   error
}

type workloadEntry struct {
	id   egress.WorkloadID
	rule egress.Rule
}

type grantCall struct {
	wl    egress.WorkloadID
	name  string
	addrs []netip.Addr
	ports []egress.Port
	ttl   time.Duration
}

func newFake() *fakeDatapath { return &fakeDatapath{workloads: map[uint64]workloadEntry{}} }

func (f *fakeDatapath) Enable(on bool) error { f.mu.Lock(); f.enabled = on; f.mu.Unlock(); return nil }
func (f *fakeDatapath) isEnabled() bool      { f.mu.Lock(); defer f.mu.Unlock(); return f.enabled }
func (f *fakeDatapath) SetWorkload(cg uint64, id egress.WorkloadID, r egress.Rule) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failSet != nil {
		return f.failSet
	}
	f.workloads[cg] = workloadEntry{id, r}
	return nil
}
func (f *fakeDatapath) RemoveWorkload(cg uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.workloads, cg)
	return nil
}
func (f *fakeDatapath) SetInternal(p []netip.Prefix) error { f.internal = p; return nil }
func (f *fakeDatapath) Grant(wl egress.WorkloadID, name string, addrs []netip.Addr, ports []egress.Port, ttl time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.grants = append(f.grants, grantCall{wl, name, slices.Clone(addrs), slices.Clone(ports), ttl})
	return nil
}

// cgroupTree makes pod and unit cgroup directories under a temporary root and
// returns the root and each directory's id (inode) by its relative path.
func cgroupTree(t *testing.T, dirs ...string) (string, map[string]uint64) {
	t.Helper()
	root := t.TempDir()
	ids := map[string]uint64{}
	for _, d := range dirs {
		p := filepath.Join(root, d)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		ids[d] = fi.Sys().(*syscall.Stat_t).Ino
	}
	return root, ids
}

func policySet(t *testing.T, ps ...egresspolicy.Policy) *egresspolicy.Set {
	t.Helper()
	for i := range ps {
		ps[i].Default()
	}
	s, err := egresspolicy.NewSet(ps)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

const (
	podA = "kubepods/besteffort/pod11111111-1111-1111-1111-111111111111"
	podB = "kubepods/besteffort/pod22222222-2222-2222-2222-222222222222"
	unit = "system.slice/app.service"
)

func TestSyncSelectsPodsAndUnitsAndFollowsChanges(t *testing.T) {
	root, ids := cgroupTree(t, podA+"/ctr1", podB, unit)
	fake := newFake()
	labels := map[string]string{"app": "web"}
	var podsMu sync.Mutex
	pods := []Pod{
		{Namespace: "shop", Name: "web", UID: "11111111-1111-1111-1111-111111111111", Labels: labels},
		{Namespace: "shop", Name: "db", UID: "22222222-2222-2222-2222-222222222222", Labels: map[string]string{"app": "db"}},
		{Namespace: "shop", Name: "pending", UID: "33333333-3333-3333-3333-333333333333", Labels: labels}, // no cgroup yet
	}
	c, err := New(Config{Datapath: fake, Grants: fake, CgroupRoot: root,
		Pods: func() []Pod { podsMu.Lock(); defer podsMu.Unlock(); return slices.Clone(pods) }})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Sync(); err != nil {
		t.Fatal(err)
	}
	if fake.enabled || len(fake.workloads) != 0 {
		t.Fatalf("no policy: enabled %v, workloads %v; want nothing", fake.enabled, fake.workloads)
	}

	web := egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "shop/web", Namespace: "shop",
		PodSelector: egresspolicy.Selector{MatchLabels: map[string]string{"app": "web"}},
		Egress:      []egresspolicy.Rule{{Names: []string{"api.example.com"}}}, FailMode: egresspolicy.FailClosed}
	vm := egresspolicy.Policy{Source: "file", Name: "app", Unit: "app.service", Mode: egresspolicy.Audit,
		Egress: []egresspolicy.Rule{{Names: []string{"*.example.org"}}}}
	c.SetPolicies("kubernetes", policySet(t, web))
	c.SetPolicies("file", policySet(t, vm))
	if err := c.Sync(); err != nil {
		t.Fatal(err)
	}
	// The pod's own cgroup (not its container's) and the unit's: web enforces
	// and stays closed without an agent, the unit audits.
	podACg := inodeOf(t, filepath.Join(root, podA))
	want := map[uint64]egress.Rule{podACg: {Enforce: true, FailClosed: true}, ids[unit]: {}}
	if !fake.enabled || len(fake.workloads) != len(want) {
		t.Fatalf("enabled %v, workloads %v; want %v", fake.enabled, fake.workloads, want)
	}
	for cg, r := range want {
		if got, ok := fake.workloads[cg]; !ok || got.rule != r || got.id == 0 {
			t.Errorf("cgroup %d: got %+v, want rule %+v and an id", cg, got, r)
		}
	}
	webID := fake.workloads[podACg].id

	// The pod's labels change: it is no longer selected; the unit stays.
	podsMu.Lock()
	pods[0].Labels = map[string]string{"app": "other"}
	podsMu.Unlock()
	if err := c.Sync(); err != nil {
		t.Fatal(err)
	}
	if _, ok := fake.workloads[podACg]; ok {
		t.Errorf("a pod no policy selects is still a workload")
	}
	if _, ok := fake.workloads[ids[unit]]; !ok {
		t.Errorf("the unit's workload went")
	}
	// Selected again: a new id (its grants went with the old one).
	podsMu.Lock()
	pods[0].Labels = labels
	podsMu.Unlock()
	if err := c.Sync(); err != nil {
		t.Fatal(err)
	}
	if got := fake.workloads[podACg].id; got == 0 || got == webID {
		t.Errorf("reselected pod has id %d, want a new non-zero id (old %d)", got, webID)
	}
	// Every policy gone: nothing selected and enforcement off.
	c.SetPolicies("kubernetes", nil)
	c.SetPolicies("file", nil)
	if err := c.Sync(); err != nil {
		t.Fatal(err)
	}
	if fake.enabled || len(fake.workloads) != 0 {
		t.Errorf("no policy left: enabled %v, workloads %v", fake.enabled, fake.workloads)
	}
}

func TestSyncKeepsAdoptedWorkloadIDs(t *testing.T) {
	root, _ := cgroupTree(t, podA)
	cg := inodeOf(t, filepath.Join(root, podA))
	fake := newFake()
	syncedController(t, fake, Config{CgroupRoot: root, Adopted: map[uint64]egress.WorkloadID{cg: 7, 999: 9}, Pods: onePod("ns", "p")},
		egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "ns/all", Namespace: "ns",
			Egress: []egresspolicy.Rule{{Names: []string{"a.example.com"}}}})
	if got := fake.workloads[cg].id; got != 7 {
		t.Errorf("adopted workload got id %d, want 7 (its pinned grants stay valid)", got)
	}
	if _, ok := fake.workloads[999]; ok {
		t.Errorf("an adopted cgroup no policy selects was kept")
	}
}

func TestSyncReportsDatapathErrors(t *testing.T) {
	root, _ := cgroupTree(t, podA)
	fake := newFake()
	fake.failSet = errors.New("map full")
	c, err := New(Config{Datapath: fake, Grants: fake, CgroupRoot: root,
		Pods: func() []Pod { return []Pod{{Namespace: "ns", Name: "p", UID: "11111111-1111-1111-1111-111111111111"}} }})
	if err != nil {
		t.Fatal(err)
	}
	c.SetPolicies("kubernetes", policySet(t, egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "ns/all", Namespace: "ns",
		Egress: []egresspolicy.Rule{{Names: []string{"a.example.com"}}}}))
	if err := c.Sync(); err == nil || c.Errors() == 0 {
		t.Fatalf("sync with a failing datapath: err %v, errors %d; want both", err, c.Errors())
	}
	if len(c.Selected()) != 0 {
		t.Errorf("a workload the datapath refused is published for grants: %v", c.Selected())
	}
}

func TestGrant(t *testing.T) {
	root, _ := cgroupTree(t, podA)
	fake := newFake()
	c := syncedController(t, fake, Config{CgroupRoot: root, Pods: onePod("ns", "p")},
		egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "ns/all", Namespace: "ns",
			Egress: []egresspolicy.Rule{
				{Names: []string{"api.example.com"}, Ports: []egresspolicy.Port{{Port: 443}, {Port: 53, Protocol: egresspolicy.UDP}}},
				{Names: []string{"*.cdn.example"}},
			}})
	wl := uint32(c.Selected()[0].ID)
	a1, a2 := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	for _, tc := range []struct {
		wl        uint32
		name      string
		wantGrant bool
		wantPorts []egress.Port
	}{
		{wl, "API.example.com.", true, []egress.Port{{Port: 53, Proto: egress.ProtoUDP}, {Port: 443, Proto: egress.ProtoTCP}}},
		{wl, "img.cdn.example.", true, nil},
		{wl, "evil.test.", false, nil},
		{0, "api.example.com.", false, nil},        // not a selected workload's query
		{wl + 100, "api.example.com.", false, nil}, // an id no policy has
	} {
		t.Run(fmt.Sprintf("%d/%s", tc.wl, tc.name), func(t *testing.T) {
			fake.grants = nil
			got, err := c.Grant(tc.wl, tc.name, []netip.Addr{a1, a2}, 30*time.Second)
			if err != nil || got != tc.wantGrant || (len(fake.grants) == 1) != tc.wantGrant {
				t.Fatalf("Grant: %v, %v, calls %v; want grant %v", got, err, fake.grants, tc.wantGrant)
			}
			if !tc.wantGrant {
				return
			}
			g := fake.grants[0]
			if g.wl != egress.WorkloadID(tc.wl) || !slices.Equal(g.addrs, []netip.Addr{a1, a2}) || g.ttl != 30*time.Second ||
				!slices.Equal(g.ports, tc.wantPorts) {
				t.Errorf("grant %+v, want workload %d, both addresses, 30s, ports %v", g, tc.wl, tc.wantPorts)
			}
		})
	}
	if got := c.NameOf(egress.WorkloadID(wl), a2); got != "evil.test." {
		t.Errorf("NameOf a denied answer's address: %q, want evil.test.", got)
	}
}

func inodeOf(t *testing.T, p string) uint64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

type fakeTap struct {
	mu     sync.Mutex
	events []tap.Event
}

func (f *fakeTap) Active() bool { return true }
func (f *fakeTap) Publish(ev *tap.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, *ev)
}

func (f *fakeTap) len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.events)
}

// TestForwardEventsNamesTheUnallowedName: a denied connect to an address the
// workload was answered for a name it may not use is published with that name;
// one to an address no answer named, without.
func TestForwardEventsNamesTheUnallowedName(t *testing.T) {
	root, _ := cgroupTree(t, podA)
	fake := newFake()
	c := syncedController(t, fake, Config{CgroupRoot: root, Pods: onePod("ns", "p")},
		egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "ns/all", Namespace: "ns",
			Egress: []egresspolicy.Rule{{Names: []string{"ok.test"}}}})
	wl := c.Selected()[0].ID
	bad := netip.MustParseAddr("198.18.1.1")
	c.Grant(uint32(wl), "exfil.test.", []netip.Addr{bad}, time.Second) //nolint:errcheck // the fake does not fail
	events := make(chan egress.Event, 2)
	events <- egress.Event{Time: time.Now(), Cgroup: 77, Workload: wl, Dst: netip.AddrPortFrom(bad, 443), Proto: egress.ProtoTCP, Verdict: egress.Denied}
	events <- egress.Event{Time: time.Now(), Cgroup: 77, Workload: wl, Dst: netip.MustParseAddrPort("198.18.2.2:53"), Proto: egress.ProtoUDP, Verdict: egress.Audited}
	close(events)
	ft := &fakeTap{}
	c.ForwardEvents(context.Background(), events, ft)
	if ft.len() != 2 {
		t.Fatalf("published %d events, want 2", ft.len())
	}
	for i, want := range []struct {
		a    tap.Answer
		name string
		dst  string
		tcp  bool
	}{{tap.Denied, "exfil.test.", "198.18.1.1:443", true}, {tap.Audited, "", "198.18.2.2:53", false}} {
		ev := ft.events[i]
		if ev.Answer != want.a || ev.Name() != want.name || ev.Dst.String() != want.dst || ev.TCP != want.tcp || ev.Key.Cgroup != 77 {
			t.Errorf("event %d: %+v (name %q), want %+v", i, ev, ev.Name(), want)
		}
	}
}

// TestUnitsByNameAndByPath: a unit name is found in system.slice or anywhere
// below the unit root; a cgroup path is taken as it is; a unit that does not
// run selects nothing.
func TestUnitsByNameAndByPath(t *testing.T) {
	root, ids := cgroupTree(t, "system.slice/a.service", "user.slice/user-1000.slice/b.service", "app.slice")
	c, err := New(Config{Datapath: newFake(), Grants: newFake(), CgroupRoot: filepath.Join(root, "kubepods"), UnitRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	for unit, want := range map[string]uint64{
		"a.service":                      ids["system.slice/a.service"],
		"b.service":                      ids["user.slice/user-1000.slice/b.service"],
		filepath.Join(root, "app.slice"): ids["app.slice"],
		"c.service":                      0,
	} {
		cg, ok := c.unitCgroup(unit)
		if ok != (want != 0) || cg.ID != want {
			t.Errorf("unit %s: %+v %v, want id %d", unit, cg, ok, want)
		}
	}
}

// TestRestartKeepsAdoptedWorkloadsUntilTheSourcesSpeak: a restarted agent that
// has not yet heard from every expected policy source neither unselects the
// workloads a previous agent left (their rule, id and grants stay) nor switches
// enforcement off; once the sources have published, it acts on what they say;
// and past Settle it acts without them.
func TestRestartKeepsAdoptedWorkloadsUntilTheSourcesSpeak(t *testing.T) {
	root, _ := cgroupTree(t, podA)
	cg := inodeOf(t, filepath.Join(root, podA))
	pods := func() []Pod { return []Pod{{Namespace: "ns", Name: "p", UID: "11111111-1111-1111-1111-111111111111"}} }
	for _, tc := range []struct {
		name   string
		settle time.Duration
		speak  bool
		kept   bool
	}{
		{"sources silent", time.Hour, false, true},
		{"sources published, selecting nothing", time.Hour, true, false},
		{"past settle", time.Nanosecond, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := newFake()
			fake.enabled = true
			fake.workloads[cg] = workloadEntry{7, egress.Rule{Enforce: true, FailClosed: true}}
			c, err := New(Config{Datapath: fake, Grants: fake, CgroupRoot: root, Pods: pods,
				Adopted: map[uint64]egress.WorkloadID{cg: 7}, Expect: []string{"kubernetes", "file"}, Settle: tc.settle})
			if err != nil {
				t.Fatal(err)
			}
			if tc.speak {
				c.SetPolicies("kubernetes", policySet(t))
				c.SetPolicies("file", policySet(t))
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
			defer cancel()
			if got := c.WaitPublished(ctx); got != tc.speak {
				t.Errorf("WaitPublished = %v, want %v", got, tc.speak)
			}
			if err := c.Sync(); err != nil {
				t.Fatal(err)
			}
			_, kept := fake.workloads[cg]
			if kept != tc.kept || fake.enabled != tc.kept {
				t.Errorf("adopted workload kept %v, enforcement on %v; want both %v", kept, fake.enabled, tc.kept)
			}
		})
	}
}

// A pod's cgroup is selected as soon as kubelet creates it, before its
// containers start, not at the next resync: a container that connects at once
// is already enforced. Kubelet makes a QoS class's parent directory with its
// first pod, so a pod in a parent that did not exist is found too.
func TestAPodCgroupIsSelectedWhenKubeletCreatesIt(t *testing.T) {
	root, _ := cgroupTree(t, "kubepods/besteffort")
	web := map[string]string{"app": "web"}
	pods := []Pod{
		{Namespace: "shop", Name: "web-1", UID: "11111111-1111-1111-1111-111111111111", Labels: web},
		{Namespace: "shop", Name: "web-2", UID: "22222222-2222-2222-2222-222222222222", Labels: web},
	}
	fake := startWatched(t, Config{CgroupRoot: root, Pods: func() []Pod { return pods }},
		egresspolicy.Policy{Source: "DNSEgressPolicy", Name: "shop/web", Namespace: "shop",
			PodSelector: egresspolicy.Selector{MatchLabels: web}, Egress: []egresspolicy.Rule{{Names: []string{"api.example.com"}}}})
	for _, dir := range []string{
		"kubepods/besteffort/pod11111111-1111-1111-1111-111111111111",
		"kubepods/burstable/pod22222222-2222-2222-2222-222222222222", // a new parent
	} {
		if err := os.MkdirAll(filepath.Join(root, dir), 0o755); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 2*time.Second, fake.selects(root, dir), "%s selected after its creation (resync is an hour)", dir)
	}
}

// A unit's cgroup is made anew (a new id) at each start: the new one is
// selected at once, not at the next resync.
func TestAUnitCgroupIsSelectedWhenSystemdCreatesIt(t *testing.T) {
	root, _ := cgroupTree(t, unit)
	fake := startWatched(t, Config{CgroupRoot: root},
		egresspolicy.Policy{Source: "file", Name: "app", Unit: "app.service", Egress: []egresspolicy.Rule{{Names: []string{"*.example.org"}}}})
	testenv.Eventually(t, 2*time.Second, fake.selects(root, unit), "the running unit selected")
	// The old directory moved away while the new one is made, so the new
	// one's id is not the old one's reused.
	dir, old := filepath.Join(root, unit), filepath.Join(root, "system.slice", "old")
	if err := os.Rename(dir, old); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(old); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 2*time.Second, fake.selects(root, unit), "the restarted unit's new cgroup selected (resync is an hour)")
}

// startWatched starts a controller over cfg (the fake datapath, a resync of
// an hour) and publishes policy, and returns once the sync it asked for has
// walked the tree: later cgroups are found only by the watch.
func startWatched(t *testing.T, cfg Config, policy egresspolicy.Policy) *fakeDatapath {
	t.Helper()
	fake := newFake()
	cfg.Resync = time.Hour
	c := newController(t, fake, cfg)
	if err := c.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetPolicies(policy.Source, policySet(t, policy))
	// Enforcement is switched on after the walk.
	testenv.Eventually(t, 5*time.Second, fake.isEnabled, "enforcement switched on")
	return fake
}

// selects reports whether the cgroup directory root/dir, as it is now, is a
// selected workload.
func (f *fakeDatapath) selects(root, dir string) func() bool {
	return func() bool {
		fi, err := os.Stat(filepath.Join(root, dir))
		if err != nil {
			return false
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		_, ok := f.workloads[fi.Sys().(*syscall.Stat_t).Ino]
		return ok
	}
}

// newController is a controller over cfg writing to fake.
func newController(t *testing.T, fake *fakeDatapath, cfg Config) *Controller {
	t.Helper()
	cfg.Datapath, cfg.Grants = fake, fake
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// syncedController is a controller over cfg writing to fake, with policy
// published and one Sync done.
func syncedController(t *testing.T, fake *fakeDatapath, cfg Config, policy egresspolicy.Policy) *Controller {
	t.Helper()
	c := newController(t, fake, cfg)
	c.SetPolicies("kubernetes", policySet(t, policy))
	if err := c.Sync(); err != nil {
		t.Fatal(err)
	}
	return c
}

// onePod lists one pod, namespace/name, whose cgroup is podA's.
func onePod(namespace, name string) func() []Pod {
	return func() []Pod {
		return []Pod{{Namespace: namespace, Name: name, UID: "11111111-1111-1111-1111-111111111111"}}
	}
}
