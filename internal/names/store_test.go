package names

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// fakeSource hands its sink to the test and waits.
type fakeSource struct {
	name string
	sink chan Sink
}

func newFake(name string) *fakeSource { return &fakeSource{name: name, sink: make(chan Sink, 1)} }

func (f *fakeSource) Name() string { return f.name }

func (f *fakeSource) Run(ctx context.Context, sink Sink) error {
	f.sink <- sink
	<-ctx.Done()
	return nil
}

// fakeClock is a Clock that moves only when the test advances it.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer // armed, not fired
}

type fakeTimer struct {
	clock *fakeClock
	at    time.Time
	c     chan time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) NewTimer(d time.Duration) Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clock: c, at: c.now.Add(d), c: make(chan time.Time, 1)}
	c.timers = append(c.timers, t)
	return t
}

// Advance moves the clock on by d and fires the timers due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.timers = slices.DeleteFunc(c.timers, func(t *fakeTimer) bool {
		if t.at.After(c.now) {
			return false
		}
		t.c <- c.now
		return true
	})
}

// Armed is how many timers wait to fire.
func (c *fakeClock) Armed() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Stop() bool {
	c := t.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	n := len(c.timers)
	c.timers = slices.DeleteFunc(c.timers, func(x *fakeTimer) bool { return x == t })
	return len(c.timers) < n
}

func newStore(t *testing.T, window time.Duration) (*Store, *prometheus.Registry) {
	t.Helper()
	return newStoreClock(t, window, nil)
}

// newStoreClock is newStore with clock (nil: the system's).
func newStoreClock(t *testing.T, window time.Duration, clock Clock) (*Store, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Window: window, Clock: clock, Metrics: m, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s, reg
}

// mustSet is sink.Set that fails the test on an error.
func mustSet(t *testing.T, sink Sink, key string, hosts []nametable.Host) {
	t.Helper()
	if err := sink.Set(key, hosts); err != nil {
		t.Fatalf("Set(%s): %v", key, err)
	}
}

// mustAdd is s.Add that fails the test on an error.
func mustAdd(t *testing.T, s *Store, src Source, opts SourceOptions) {
	t.Helper()
	if err := s.Add(src, opts); err != nil {
		t.Fatalf("Add(%s): %v", src.Name(), err)
	}
}

func host(name, ip string) []nametable.Host {
	return []nametable.Host{{Name: name, V4: []netip.Addr{netip.MustParseAddr(ip)}}}
}

func waitTable(t *testing.T, s *Store, what string, cond func(*nametable.Table) bool) *nametable.Table {
	t.Helper()
	var tb *nametable.Table
	if !testenv.WaitFor(5*time.Second, func() bool {
		tb = s.Table()
		return tb != nil && cond(tb)
	}) {
		t.Fatalf("not within 5s: %s", what)
	}
	return tb
}

func addr(tb *nametable.Table, name string) string {
	n := tb.Lookup(name)
	if n == nil || len(n.Host.V4) == 0 {
		return ""
	}
	return n.Host.V4[0].String()
}

// Not ready until every blocking source synced; a non-blocking one never
// holds readiness back; Ready names what is missing.
func TestReadiness(t *testing.T) {
	s, _ := newStore(t, DefaultWindow)
	a, b, remote := newFake("a"), newFake("b"), newFake("cluster/remote")
	for _, src := range []*fakeSource{a, b} {
		if err := s.Add(src, SourceOptions{Priority: 10}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Add(remote, SourceOptions{Priority: 5, NonBlocking: true}); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(newFake("a"), SourceOptions{}); err == nil {
		t.Fatalf("a second source named a is accepted")
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	sa, sb := <-a.sink, <-b.sink
	<-remote.sink
	mustSet(t, sa, "x", host("x.example.com", "192.0.2.1"))
	sa.Synced()
	sb.Failed(errors.New("connection refused"))
	s.publish() // what the publisher does at a change: here nothing, as b is waited for
	if s.Table() != nil {
		t.Fatalf("a table is published before b synced")
	}
	if err := s.Ready(); err == nil || !strings.Contains(err.Error(), "b (connection refused)") || strings.Contains(err.Error(), "remote") {
		t.Fatalf("Ready = %v, want it to name b and its error only", err)
	}
	sb.Failed(nil)
	sb.Synced()
	waitTable(t, s, "first table", func(tb *nametable.Table) bool { return addr(tb, "x.example.com.") == "192.0.2.1" })
	if err := s.Ready(); err != nil {
		t.Fatalf("Ready = %v", err)
	}
}

// An optional source holds readiness back while it works towards its first
// state, not while it fails: the store is ready without it, Status says so,
// and when it recovers its first complete state is published in one
// snapshot. A required source that fails still holds readiness back
// (TestReadiness).
func TestOptionalSourceFailingDoesNotBlock(t *testing.T) {
	s, _ := newStore(t, DefaultWindow)
	k, se := newFake("kubernetes"), newFake("serviceentries")
	if err := s.Add(k, SourceOptions{Priority: 80}); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(se, SourceOptions{Priority: 40, Optional: true}); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	ks, ses := <-k.sink, <-se.sink
	mustSet(t, ks, "default/web", host("web.default.svc.cluster.local", "10.96.0.10"))
	ks.Synced()
	// Not failing: still waited for (readiness is decided under the lock
	// as the sources report, so no table can have been published).
	if err := s.Ready(); err == nil || !strings.Contains(err.Error(), "serviceentries") || s.Table() != nil {
		t.Fatalf("Ready = %v, table %v: want not ready, waiting for serviceentries", err, s.Table())
	}
	ses.Failed(errors.New("serviceentries is forbidden"))
	waitTable(t, s, "ready without the failing optional source", func(tb *nametable.Table) bool {
		return addr(tb, "web.default.svc.cluster.local.") == "10.96.0.10"
	})
	if err := s.Ready(); err != nil {
		t.Fatalf("Ready = %v", err)
	}
	st := statusOf(t, s, "serviceentries")
	if !st.Optional || st.Synced || st.FailingSince.IsZero() || !strings.Contains(st.LastError, "forbidden") {
		t.Fatalf("status %+v: want optional, not synced, failing with the error", st)
	}
	// Allowed again: the whole first state goes out in one snapshot.
	ses.Failed(nil)
	mustSet(t, ses, "infra/a", host("a.example.com", "192.0.2.1"))
	mustSet(t, ses, "infra/b", host("b.example.com", "192.0.2.2"))
	if tb := s.Table(); addr(tb, "a.example.com.") != "" {
		t.Fatalf("part of the optional source's first state was published before it synced")
	}
	ses.Synced()
	waitTable(t, s, "the optional source's state", func(tb *nametable.Table) bool {
		return addr(tb, "a.example.com.") == "192.0.2.1" && addr(tb, "b.example.com.") == "192.0.2.2"
	})
	if st := statusOf(t, s, "serviceentries"); !st.Synced || !st.FailingSince.IsZero() {
		t.Fatalf("status %+v: want synced and healthy", st)
	}
}

func statusOf(t *testing.T, s *Store, name string) SourceStatus {
	t.Helper()
	for _, st := range s.Status() {
		if st.Name == name {
			return st
		}
	}
	t.Fatalf("no source %s in %+v", name, s.Status())
	return SourceStatus{}
}

// An isolated update is published at once; a burst within the window is
// one snapshot, published when the window ends, and the last state wins.
// The store's clock is the test's: it moves only when the test moves it.
func TestPublishLatencyAndCoalescing(t *testing.T) {
	const window = 5 * time.Second
	clock := newFakeClock()
	s, reg := newStoreClock(t, window, clock)
	src := newFake("k")
	mustAdd(t, s, src, SourceOptions{Priority: 10})
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	k := <-src.sink
	k.Synced()
	waitTable(t, s, "first table", func(*nametable.Table) bool { return true })
	clock.Advance(window) // a window after the first publish

	mustSet(t, k, "a", host("a.example.com", "192.0.2.1"))
	first := waitTable(t, s, "isolated update, the clock standing still", func(tb *nametable.Table) bool {
		return addr(tb, "a.example.com.") == "192.0.2.1"
	})

	before := metrictest.Value(t, reg, "meshdns_names_publishes_total")
	for i := range 200 {
		mustSet(t, k, "b", host("b.example.com", fmt.Sprintf("192.0.2.%d", i%250+1)))
	}
	// The burst came within a window of the last publish: the publisher
	// arms a timer for the window's end and publishes nothing before.
	// Once its kicks are all taken, nothing but the timer can publish.
	if !testenv.WaitFor(5*time.Second, func() bool { return clock.Armed() == 1 && len(s.kick) == 0 }) {
		t.Fatalf("no timer armed for the end of the window after a burst (%d armed)", clock.Armed())
	}
	if tb := s.Table(); tb != first {
		t.Fatalf("a table (serial %d) was published within the window, before its end", tb.Serial())
	}
	clock.Advance(window)
	last := waitTable(t, s, "last of the burst", func(tb *nametable.Table) bool { return addr(tb, "b.example.com.") == "192.0.2.200" })
	if last.Serial() != first.Serial()+1 {
		t.Errorf("the burst went out as serials %d..%d, want one snapshot", first.Serial()+1, last.Serial())
	}
	if n := metrictest.Value(t, reg, "meshdns_names_publishes_total") - before; n != 1 {
		t.Errorf("200 updates in a burst made %v snapshots, want 1", n)
	}
	if n := clock.Armed(); n != 0 {
		t.Errorf("%d timers armed after the burst went out, want none", n)
	}
}

// Removing a source removes its names; its status and metrics go too.
func TestRemoveSourceAndStatus(t *testing.T) {
	s, reg := newStore(t, time.Millisecond)
	a, b := newFake("a"), newFake("b")
	mustAdd(t, s, a, SourceOptions{Priority: 10})
	mustAdd(t, s, b, SourceOptions{Priority: 5, NonBlocking: true})
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	sa, sb := <-a.sink, <-b.sink
	sa.Synced()
	mustSet(t, sb, "y", host("y.example.com", "192.0.2.2"))
	if err := sb.SetClients("pod", []netip.Addr{netip.MustParseAddr("10.244.0.9")}, "ns1"); err != nil {
		t.Fatal(err)
	}
	sb.Failed(errors.New("unreachable"))
	waitTable(t, s, "b's host", func(tb *nametable.Table) bool { return addr(tb, "y.example.com.") == "192.0.2.2" })
	st := s.Status()
	if len(st) != 2 || st[1].Name != "b" || st[1].Objects != 1 || st[1].Clients != 1 || st[1].FailingSince.IsZero() || st[1].LastError != "unreachable" {
		t.Fatalf("status = %+v", st)
	}
	if v := metrictest.Value(t, reg, "meshdns_names_source_stale_seconds", "source", "b"); v <= 0 {
		t.Fatalf("stale seconds of a failing source = %v", v)
	}
	if err := sb.Set("bad", []nametable.Host{{Name: "a..b"}}); err == nil {
		t.Fatalf("a bad host is accepted")
	}
	if v := metrictest.Value(t, reg, "meshdns_names_source_errors_total", "source", "b"); v != 2 {
		t.Fatalf("errors of b = %v, want 2 (the failure and the bad host)", v)
	}
	s.Remove("b")
	waitTable(t, s, "b's host gone", func(tb *nametable.Table) bool {
		_, known := tb.ClientNamespace(netip.MustParseAddr("10.244.0.9"))
		return addr(tb, "y.example.com.") == "" && !known
	})
	if st := s.Status(); len(st) != 1 || st[0].Name != "a" {
		t.Fatalf("status after remove = %+v", st)
	}
}

// An audit compares the source's count of its origin with the objects the
// store holds for it; a mismatch is counted in status and metrics and
// returned, so the source delivers its state again.
func TestAudit(t *testing.T) {
	s, reg := newStore(t, time.Millisecond)
	src := newFake("k")
	if err := s.Add(src, SourceOptions{Priority: PriorityKubernetes}); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	sink := <-src.sink
	for i, name := range []string{"a.example.com", "b.example.com"} {
		if err := sink.Set(fmt.Sprint(i), host(name, "10.0.0.1")); err != nil {
			t.Fatal(err)
		}
	}
	if err := sink.Audit(2); err != nil {
		t.Errorf("Audit(2) with 2 objects: %v", err)
	}
	err := sink.Audit(3)
	if err == nil || !strings.Contains(err.Error(), "holds 2 objects, its origin 3") {
		t.Errorf("Audit(3) with 2 objects: %v, want a mismatch", err)
	}
	if st := s.Status(); len(st) != 1 || st[0].AuditMismatches != 1 {
		t.Errorf("status after one mismatch: %+v", st)
	}
	if v := metrictest.Value(t, reg, "meshdns_names_source_audit_mismatches_total", "source", "k"); v != 1 {
		t.Errorf("meshdns_names_source_audit_mismatches_total = %v, want 1", v)
	}
}

// A large change is applied in steps, and no table holds part of it: while
// it is applied, a publish (here forced between two of its steps, while
// another source changes too) leaves the last table serving, and the next
// table has all of it, with the other source's change. A change with a bad
// host changes nothing.
func TestApplyIsPublishedWhole(t *testing.T) {
	s, _ := newStore(t, time.Millisecond)
	file, other := newFake("file"), newFake("other")
	if err := s.Add(file, SourceOptions{Priority: PriorityFile}); err != nil {
		t.Fatal(err)
	}
	if err := s.Add(other, SourceOptions{Priority: PriorityKubernetes}); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	fs, os := <-file.sink, <-other.sink
	n := 3*ApplyStep + 7
	change := func(ip string) *nametable.Change {
		c := &nametable.Change{}
		for i := range n {
			h := host(fmt.Sprintf("h%d.example.com", i), ip)[0]
			c.Set = append(c.Set, nametable.KeyHost{Key: h.Name, Host: &h})
		}
		return c
	}
	if err := fs.Apply(change("192.0.2.1")); err != nil {
		t.Fatal(err)
	}
	fs.Synced()
	os.Synced()
	last := fmt.Sprintf("h%d.example.com.", n-1)
	waitTable(t, s, "the first change", func(tb *nametable.Table) bool { return addr(tb, last) == "192.0.2.1" })

	steps := 0
	s.betweenSteps = func() {
		steps++
		if err := os.Set("o", host("o.example.com", "192.0.2.9")); err != nil {
			t.Error(err)
		}
		s.publish()
		tb := s.Table()
		if got := addr(tb, "h0.example.com."); got != "192.0.2.1" {
			t.Errorf("step %d: a table with part of the change was published (h0 = %s)", steps, got)
		}
		if addr(tb, "o.example.com.") != "" {
			t.Errorf("step %d: a table was published while the change was applied", steps)
		}
	}
	if err := fs.Apply(change("192.0.2.2")); err != nil {
		t.Fatal(err)
	}
	s.betweenSteps = nil
	if steps != 3 {
		t.Errorf("%d steps between the change's parts, want 3", steps)
	}
	waitTable(t, s, "the whole change and the other source's", func(tb *nametable.Table) bool {
		return addr(tb, "h0.example.com.") == "192.0.2.2" && addr(tb, last) == "192.0.2.2" && addr(tb, "o.example.com.") == "192.0.2.9"
	})

	bad := change("192.0.2.3")
	bad.Set[len(bad.Set)-1].Host.Name = "not a name"
	if err := fs.Apply(bad); err == nil {
		t.Fatal("a change with a bad host was applied")
	}
	s.publish()
	if got := addr(s.Table(), "h0.example.com."); got != "192.0.2.2" {
		t.Errorf("after a refused change, h0 = %s, want 192.0.2.2", got)
	}
}

// Config.LargeChange hears of the changes that replace at least a quarter of
// the table's hosts: it begins before such a change is applied (while the
// previous table is current) and ends once the table with it is published; a
// first load ends one without a beginning (there was nothing to replace), and
// smaller changes are not told of.
func TestLargeChangeIsToldItsBeginningAndEnd(t *testing.T) {
	events := make(chan string, 8) // "begin <serial current>", "end <serial published>", in order
	var s *Store
	s, err := New(Config{Window: time.Millisecond, Logger: slog.New(slog.DiscardHandler),
		LargeChange: func(begins bool) {
			tb := s.cur.Load() // the store's lock is held: not s.Table()
			if begins {
				events <- fmt.Sprintf("begin %d", tb.Serial())
			} else {
				events <- fmt.Sprintf("end %d", tb.Serial())
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	file := newFake("file")
	mustAdd(t, s, file, SourceOptions{Priority: PriorityFile})
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	fs := <-file.sink
	change := func(from, to int, ip string) *nametable.Change {
		c := &nametable.Change{}
		for i := from; i < to; i++ {
			h := host(fmt.Sprintf("h%d.example.com", i), ip)[0]
			c.Set = append(c.Set, nametable.KeyHost{Key: h.Name, Host: &h})
		}
		return c
	}
	next := func() string {
		t.Helper()
		select {
		case e := <-events:
			return e
		case <-time.After(5 * time.Second):
			t.Fatal("no event within 5s")
			return ""
		}
	}
	if err := fs.Apply(change(0, 100, "192.0.2.1")); err != nil {
		t.Fatal(err)
	}
	fs.Synced()
	if got := next(); got != "end 1" {
		t.Errorf("after the first load: %q, want \"end 1\"", got)
	}
	if err := fs.Apply(change(0, 24, "192.0.2.2")); err != nil { // 24 of 100: small
		t.Fatal(err)
	}
	small := waitTable(t, s, "the small change", func(tb *nametable.Table) bool { return addr(tb, "h23.example.com.") == "192.0.2.2" }).Serial()
	if err := fs.Apply(change(50, 75, "192.0.2.3")); err != nil { // 25 of 100: large
		t.Fatal(err)
	}
	large := waitTable(t, s, "the large change", func(tb *nametable.Table) bool { return addr(tb, "h74.example.com.") == "192.0.2.3" }).Serial()
	for _, want := range []string{fmt.Sprintf("begin %d", small), fmt.Sprintf("end %d", large)} {
		if got := next(); got != want {
			t.Errorf("event %q, want %q (the small change's table is %d, the large one's %d)", got, want, small, large)
		}
	}
}
