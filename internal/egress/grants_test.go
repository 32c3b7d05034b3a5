package egress

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// fakeStore is a grant map in memory, with the kernel map's cap.
type fakeStore struct {
	mu     sync.Mutex
	limit  int
	m      map[redirect.EgressGrantKey]redirect.EgressGrant
	writes int
}

func newFakeStore(limit int) *fakeStore {
	return &fakeStore{limit: limit, m: map[redirect.EgressGrantKey]redirect.EgressGrant{}}
}

func (s *fakeStore) Put(k *redirect.EgressGrantKey, v *redirect.EgressGrant) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[*k]; !ok && len(s.m) >= s.limit {
		return errors.New("map full (E2BIG)")
	}
	s.m[*k] = *v
	s.writes++
	return nil
}

func (s *fakeStore) Delete(k *redirect.EgressGrantKey) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, *k)
	return nil
}

func (s *fakeStore) has(wl WorkloadID, a netip.Addr) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.m[redirect.EgressGrantKey{Workload: uint32(wl), Addr: addrWords(a)}]
	return ok
}

func (s *fakeStore) get(wl WorkloadID, a netip.Addr) redirect.EgressGrant {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.m[redirect.EgressGrantKey{Workload: uint32(wl), Addr: addrWords(a)}]
}

func (s *fakeStore) count(wl WorkloadID) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for k := range s.m {
		if k.Workload == uint32(wl) {
			n++
		}
	}
	return n
}

// fakeClock is a settable CLOCK_MONOTONIC.
type fakeClock struct{ ns int64 }

func (c *fakeClock) now() int64 { return c.ns }

func addrN(i int) netip.Addr { return netip.AddrFrom4([4]byte{198, 18, byte(i >> 8), byte(i)}) }

func grantOrFail(t *testing.T, g *Grants, wl WorkloadID, ttl time.Duration, addrs ...netip.Addr) {
	t.Helper()
	if err := g.Grant(wl, "x.test", addrs, nil, ttl); err != nil {
		t.Fatalf("Grant(%d, %v): %v", wl, addrs, err)
	}
}

// At the cap, an expired grant of any workload gives way first, then the
// granting workload's own grant closest to expiry; another workload's live
// grants never do, and a workload with none of its own is refused.
func TestGrantEvictionOrder(t *testing.T) {
	clk := &fakeClock{ns: int64(time.Hour)}
	s := newFakeStore(4)
	g := newGrants(s, 4, 4, time.Second, clk.now)
	grantOrFail(t, g, 1, time.Minute, addrN(1), addrN(2))
	grantOrFail(t, g, 2, 10*time.Second, addrN(3)) // expires first
	grantOrFail(t, g, 2, time.Minute, addrN(4))
	clk.ns += int64(30 * time.Second) // workload 2's first grant has expired
	grantOrFail(t, g, 1, time.Minute, addrN(5))
	if s.has(2, addrN(3)) || !s.has(2, addrN(4)) || !s.has(1, addrN(5)) {
		t.Errorf("the expired grant of workload 2 should have given way: %v", s.m)
	}
	// Full, nothing expired: workload 1 gives up its own closest to expiry.
	grantOrFail(t, g, 1, 2*time.Minute, addrN(6))
	if s.has(1, addrN(1)) && s.has(1, addrN(2)) || !s.has(2, addrN(4)) {
		t.Errorf("workload 1's oldest should have given way, workload 2's live grant stayed: %v", s.m)
	}
	// Workload 3 holds nothing it could give up.
	if err := g.Grant(3, "y.test", []netip.Addr{addrN(7)}, nil, time.Minute); !errors.Is(err, ErrFull) {
		t.Errorf("a full map with no expired grant and none of workload 3: %v, want ErrFull", err)
	}
	if total, _ := g.Len(1); total != 4 || len(s.m) != 4 {
		t.Errorf("%d grants in the bookkeeping, %d in the map, cap 4", total, len(s.m))
	}
}

// A workload at its quota replaces its own grant closest to expiry (an
// expired one first); a flood of distinct grants from one workload leaves
// another workload's grants alone, and the map stays within its cap.
func TestGrantQuota(t *testing.T) {
	clk := &fakeClock{ns: int64(time.Hour)}
	s := newFakeStore(100)
	g := newGrants(s, 100, 10, time.Second, clk.now)
	for i := range 5 {
		grantOrFail(t, g, 1, time.Minute, addrN(i))
	}
	for i := range 10_000 {
		grantOrFail(t, g, 2, time.Duration(i)*time.Millisecond+time.Minute, addrN(1000+i%5000))
	}
	if n1, n2 := s.count(1), s.count(2); n1 != 5 || n2 != 10 || len(s.m) > 100 {
		t.Errorf("workload 1 holds %d (want 5), workload 2 %d (want its quota, 10), the map %d", n1, n2, len(s.m))
	}
	for i := range 5 {
		if !s.has(1, addrN(i)) {
			t.Errorf("workload 1 lost %s", addrN(i))
		}
	}
	// The last ten of the flood are what workload 2 holds: each new one
	// replaced the one closest to expiry.
	for i := 9990; i < 10_000; i++ {
		if !s.has(2, addrN(1000+i%5000)) {
			t.Errorf("workload 2 lacks its latest grant %s", addrN(1000+i%5000))
		}
	}
}

// A grant the workload holds is extended, never shortened, and its ports
// joined; an expired one is replaced; a refresh that changes nothing writes
// nothing; too many ports leave the grant as it was.
func TestGrantMerge(t *testing.T) {
	clk := &fakeClock{ns: int64(time.Hour)}
	s := newFakeStore(10)
	g := newGrants(s, 10, 10, time.Second, clk.now)
	a := addrN(1)
	web := []Port{{Port: 443, Proto: ProtoTCP}}
	if err := g.Grant(1, "a.test", []netip.Addr{a}, web, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := g.Grant(1, "b.test", []netip.Addr{a}, []Port{{Port: 53, Proto: ProtoUDP}, {Port: 443, Proto: ProtoTCP}}, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	v := s.get(1, a)
	if v.Nports != 2 || v.Expiry != uint64(clk.ns+int64(61*time.Second)) {
		t.Errorf("joined grant %+v: want 2 ports and the later expiry", v)
	}
	writes := s.writes
	if err := g.Grant(1, "a.test", []netip.Addr{a}, web, 5*time.Second); err != nil || s.writes != writes {
		t.Errorf("a grant that adds nothing wrote %d times (err %v)", s.writes-writes, err)
	}
	many := make([]Port, 7)
	for i := range many {
		many[i] = Port{Port: uint16(1000 + i), Proto: ProtoTCP}
	}
	if err := g.Grant(1, "c.test", []netip.Addr{a}, many, time.Minute); !errors.Is(err, ErrTooManyPorts) {
		t.Errorf("9 ports: %v, want ErrTooManyPorts", err)
	}
	if got := s.get(1, a); got != v {
		t.Errorf("a refused grant changed the map: %+v, was %+v", got, v)
	}
	if err := g.Grant(1, "d.test", []netip.Addr{a}, nil, time.Minute); err != nil || s.get(1, a).Nports != 0 {
		t.Errorf("a grant of any port: %+v %v, want any (0 ports)", s.get(1, a), err)
	}
	clk.ns += int64(2 * time.Minute)
	if err := g.Grant(1, "e.test", []netip.Addr{a}, web, time.Minute); err != nil || s.get(1, a).Nports != 1 {
		t.Errorf("an expired any-port grant granted again for 443: %+v %v, want only 443", s.get(1, a), err)
	}
	if n, err := g.Sweep(); n != 0 || err != nil {
		t.Errorf("Sweep removed %d live grants (%v)", n, err)
	}
	clk.ns += int64(2 * time.Minute)
	if n, err := g.Sweep(); n != 1 || err != nil || len(s.m) != 0 {
		t.Errorf("Sweep removed %d (%v), %d left", n, err, len(s.m))
	}
}

// Many resolver goroutines grant at once: the bookkeeping and the map agree
// and stay within the cap and quotas (run with -race too).
func TestGrantConcurrent(t *testing.T) {
	clk := &fakeClock{ns: int64(time.Hour)}
	s := newFakeStore(200)
	g := newGrants(s, 200, 50, time.Second, clk.now)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				if err := g.Grant(WorkloadID(1+w%4), "c.test", []netip.Addr{addrN(i % 300)}, nil, time.Minute); err != nil {
					t.Errorf("Grant: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	total, _ := g.Len(1)
	if total != len(s.m) || total > 200 {
		t.Errorf("%d grants in the bookkeeping, %d in the map (cap 200)", total, len(s.m))
	}
	for wl := WorkloadID(1); wl <= 4; wl++ {
		if n := s.count(wl); n != 50 {
			t.Errorf("workload %d holds %d, want its quota of 50", wl, n)
		}
	}
}

// BenchmarkGrant is one Grant of one address: "refresh" extends a grant the
// workload holds, "new" a distinct address each time (its quota full, so
// each replaces its oldest); "map" writes the kernel's hash map, "memory" an
// in-memory fake (the bookkeeping alone).
func BenchmarkGrant(b *testing.B) {
	for _, store := range []string{"memory", "map"} {
		for _, kind := range []string{"refresh", "new"} {
			b.Run(store+"/"+kind, func(b *testing.B) {
				var st grantStore = newFakeStore(1 << 20)
				if store == "map" {
					st = mapStore{benchMap(b, 65536)}
				}
				g := newGrants(st, 65536, 4096, DefaultGrace, monotonicNow)
				addrs := make([][]netip.Addr, 8192)
				for i := range addrs {
					addrs[i] = []netip.Addr{addrN(i)}
				}
				for i := range 4096 {
					if err := g.Grant(1, "b.test", addrs[i], nil, time.Minute); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					a := addrs[i%4096]
					if kind == "new" {
						a = addrs[4096+i%4096]
						if i%8192 >= 4096 {
							a = addrs[i%4096]
						}
					}
					if err := g.Grant(1, "b.test", a, nil, time.Minute+time.Duration(i)); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// benchMap is a hash map shaped like egress_grants.
func benchMap(b *testing.B, n int) *ebpf.Map {
	testenv.RequirePrivileged(b)
	if err := rlimit.RemoveMemlock(); err != nil {
		b.Fatal(err)
	}
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: uint32(unsafe.Sizeof(redirect.EgressGrantKey{})), ValueSize: uint32(unsafe.Sizeof(redirect.EgressGrant{})), MaxEntries: uint32(n), Flags: 1 /* BPF_F_NO_PREALLOC */})
	if err != nil {
		b.Fatal(fmt.Errorf("create a grant map: %w", err))
	}
	b.Cleanup(func() { m.Close() })
	return m
}

// Close before or without Start releases nothing and closes the event stream.
func TestCloseWithoutStart(t *testing.T) {
	e, err := New(Config{Datapath: new(redirect.Datapath)})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := <-e.Events(); ok {
		t.Error("an event from an Egress never started")
	}
	if err := e.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := e.Start(t.Context()); err == nil {
		t.Error("Start after Close succeeded")
	}
}
