package kubesource

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// hostSink records the last hosts of each key, as the store keeps them. A
// Set of no hosts for the key in pause waits until release is closed: the
// test holds a computation between its read and its delivery.
type hostSink struct {
	mu      sync.Mutex
	hosts   map[string][]string
	pause   string
	held    atomic.Bool
	paused  chan struct{} // closed when the paused Set arrived
	release chan struct{}
}

func newHostSink(pause string) *hostSink {
	return &hostSink{hosts: map[string][]string{}, pause: pause, paused: make(chan struct{}), release: make(chan struct{})}
}

func (s *hostSink) Set(key string, hosts []nametable.Host) error {
	if key == s.pause && len(hosts) == 0 && s.held.CompareAndSwap(false, true) {
		close(s.paused)
		<-s.release
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(hosts) == 0 {
		delete(s.hosts, key)
		return nil
	}
	var names []string
	for _, h := range hosts {
		names = append(names, h.Name+addrs(h))
	}
	s.hosts[key] = names
	return nil
}

func addrs(h nametable.Host) string {
	if len(h.V4)+len(h.V6) == 0 {
		return ""
	}
	return fmt.Sprint(append(slices.Clone(h.V4), h.V6...))
}

func (s *hostSink) SetClients(string, []netip.Addr, string) error { return nil }
func (s *hostSink) Apply(c *nametable.Change) error {
	for _, e := range c.Set {
		if err := s.Set(e.Key, []nametable.Host{*e.Host}); err != nil {
			return err
		}
	}
	for _, k := range c.Gone {
		if err := s.Set(k, nil); err != nil {
			return err
		}
	}
	return nil
}

func (s *hostSink) Load(map[string]nametable.Host, map[netip.Addr]string) error {
	return nil
}
func (s *hostSink) Synced()      {}
func (s *hostSink) Failed(error) {}
func (s *hostSink) Audit(expected int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.hosts) != expected {
		return fmt.Errorf("%d objects, want %d", len(s.hosts), expected)
	}
	return nil
}

func (s *hostSink) state() map[string][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.hosts)
}

// informers stands in for the two informers: their stores, and their
// handlers called as client-go calls them (after the store changed).
type informers struct {
	svcs, eps     cache.Store
	svcH, sliceH  cache.ResourceEventHandler
	lastSvc       map[string]*service
	lastSliceObjs map[string]*endpointSlice
}

func newInformers(r *services, svcs cache.Store) *informers {
	return &informers{
		svcs: svcs, eps: cache.NewStore(cache.MetaNamespaceKeyFunc),
		svcH: r.serviceHandler(), sliceH: r.sliceHandler(),
	}
}

// put adds obj to store, or updates it, and tells h as an informer would.
func put(store cache.Store, h cache.ResourceEventHandler, obj any) {
	old, ok, _ := store.Get(obj)
	_ = store.Add(obj)
	if ok {
		h.OnUpdate(old, obj)
	} else {
		h.OnAdd(obj, false)
	}
}

func (in *informers) putService(s *service) { put(in.svcs, in.svcH, s) }

func (in *informers) deleteService(s *service) {
	_ = in.svcs.Delete(s)
	in.svcH.OnDelete(s)
}

func (in *informers) putSlice(es *endpointSlice) { put(in.eps, in.sliceH, es) }

func (in *informers) deleteSlice(es *endpointSlice) {
	_ = in.eps.Delete(es)
	in.sliceH.OnDelete(es)
}

// relist replays the stores as a relist after a watch error does: an
// update of every object (a resync delivers the same).
func (in *informers) relist() {
	for _, o := range in.svcs.List() {
		in.svcH.OnUpdate(o, o)
	}
	for _, o := range in.eps.List() {
		in.sliceH.OnUpdate(o, o)
	}
}

func clusterIPService(ns, name, ip string) *service {
	return &service{Meta: kubeclient.Meta{Name: name, Namespace: ns}, clusterIPs: []netip.Addr{netip.MustParseAddr(ip)}}
}

func headlessService(ns, name string) *service {
	return &service{Meta: kubeclient.Meta{Name: name, Namespace: ns}, headless: true}
}

func epSlice(ns, name, svc string, ips ...string) *endpointSlice {
	es := &endpointSlice{Meta: kubeclient.Meta{Name: name, Namespace: ns}, service: svc}
	for _, ip := range ips {
		es.endpoints = append(es.endpoints, endpoint{addrs: []netip.Addr{netip.MustParseAddr(ip)}, ready: true})
	}
	return es
}

// The hosts each key has once every event was delivered are a function of
// the informers' final state, whatever the order of the events, the
// goroutines the handlers run on, and a computation held between its read
// of the informers and its delivery (the handler-side recomputation of
// before published "no Service" over the Service's hosts: NXDOMAIN for a
// Service that existed, until it next changed).
func TestServiceHostsFollowFinalState(t *testing.T) {
	web := clusterIPService("a", "web", "10.96.0.10")
	webSlice := epSlice("a", "web-1", "web", "10.244.0.5")
	db := headlessService("a", "db")
	dbSlice := epSlice("a", "db-1", "db", "10.244.0.6", "10.244.0.7")
	dbSlice2 := epSlice("a", "db-1", "db", "10.244.0.6")
	moved := epSlice("a", "db-1", "web", "10.244.0.6")
	cases := []finalStateCase{
		{name: "service before slice", steps: func(in *informers) {
			in.putService(web)
			in.putSlice(webSlice)
		}},
		{name: "slice before service", steps: func(in *informers) {
			in.putSlice(webSlice)
			in.putService(web)
		}},
		{name: "slice handler overtaken by the service handler", pause: "a/web",
			steps:      func(in *informers) { in.putSlice(webSlice) },
			concurrent: func(in *informers) { in.putService(web) }},
		{name: "headless slice overtaken", pause: "a/db",
			steps:      func(in *informers) { in.putSlice(dbSlice) },
			concurrent: func(in *informers) { in.putService(db) }},
		{name: "both informers at once", steps: func(in *informers) {
			var wg sync.WaitGroup
			wg.Go(func() {
				in.putSlice(webSlice)
				in.putSlice(dbSlice)
			})
			wg.Go(func() {
				in.putService(db)
				in.putService(web)
			})
			wg.Wait()
		}},
		{name: "slice changes while its service is recomputed", pause: "a/db",
			steps: func(in *informers) { in.putSlice(dbSlice) },
			concurrent: func(in *informers) {
				in.putService(db)
				in.putSlice(dbSlice2)
			}},
		{name: "slice moves to another service", steps: func(in *informers) {
			in.putService(web)
			in.putService(db)
			in.putSlice(dbSlice)
			in.putSlice(moved)
		}},
		{name: "service deleted and created again", steps: func(in *informers) {
			in.putService(web)
			in.putSlice(webSlice)
			in.deleteService(web)
			in.putService(web)
		}},
		{name: "service deleted while its slice is delivered", pause: "a/web",
			steps: func(in *informers) {
				in.putService(web)
				in.putSlice(webSlice)
				in.deleteService(web)
			},
			concurrent: func(in *informers) { in.putService(web) }},
		{name: "slice deleted", steps: func(in *informers) {
			in.putService(db)
			in.putSlice(dbSlice)
			in.deleteSlice(dbSlice)
		}},
		{name: "relist after a watch error", steps: func(in *informers) {
			in.putSlice(dbSlice)
			in.putService(web)
			in.putService(db)
			in.relist()
			in.deleteSlice(dbSlice)
			in.relist()
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.run(t) })
	}
}

// finalStateCase is one sequence of informer events.
type finalStateCase struct {
	name string
	// pause holds the first delivery of no hosts for this key until
	// the steps of concurrent have returned.
	pause      string
	steps      func(in *informers)
	concurrent func(in *informers)
}

// run delivers the case's events and checks the hosts against those of the
// informers' final state.
func (c finalStateCase) run(t *testing.T) {
	sink := newHostSink(c.pause)
	ctx, r, in := runServices(t, sink)

	stepsDone := make(chan struct{})
	go func() { defer close(stepsDone); c.steps(in) }()
	if c.pause != "" {
		select {
		case <-sink.paused:
		case <-time.After(10 * time.Second):
			t.Fatalf("no delivery of no hosts for %s to hold", c.pause)
		}
		// The other informer's handler runs to its end while the
		// first computation is held.
		c.concurrent(in)
		close(sink.release)
	}
	<-stepsDone
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	// Delivered, and no audit yet: the ordering alone must be right.
	if !r.queue.idle(wctx) {
		t.Fatal("changes not delivered within 10 s")
	}
	got, exp := sink.state(), hostsFromScratch(in)
	if !maps.EqualFunc(got, exp, slices.Equal) {
		t.Errorf("hosts after every event\n got %v\nwant %v", got, exp)
	}
}

// runServices runs the Services source over a new store, delivering to
// sink, until the test ends; ctx ends with it.
func runServices(t *testing.T, sink names.Sink) (context.Context, *services, *informers) {
	svcs := cache.NewStore(cache.MetaNamespaceKeyFunc)
	r := newServices("cluster.local.", svcs, sink, slog.Default())
	in := newInformers(r, svcs)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { r.run(ctx) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return ctx, r, in
}

// hostsFromScratch is what the hosts of the informers' final state are,
// computed from scratch.
func hostsFromScratch(in *informers) map[string][]string {
	out := map[string][]string{}
	idx := &sliceIndex{m: map[string][]*endpointSlice{}}
	for _, o := range in.eps.List() {
		idx.set(sliceService(o), o)
	}
	for _, o := range in.svcs.List() {
		s := o.(*service)
		var names []string
		for _, h := range serviceHosts("cluster.local.", s, idx.of(s.Key())) {
			names = append(names, h.Name+addrs(h))
		}
		out[s.Key()] = names
	}
	return out
}

// An audit that finds the store lost an object makes the source deliver
// every Service again before it syncs.
func TestAuditRecomputes(t *testing.T) {
	sink := &dropOnce{hostSink: newHostSink(""), drop: "a/web"}
	ctx, r, in := runServices(t, sink)
	in.putService(clusterIPService("a", "web", "10.96.0.10"))
	in.putService(headlessService("a", "db"))
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	if !r.settle(wctx) {
		t.Fatal("not settled within 10 s")
	}
	if got := sink.state(); len(got) != 2 {
		t.Errorf("after settle the store holds %v, want a/web and a/db", slices.Sorted(maps.Keys(got)))
	}
	if sink.audits != 2 || sink.mismatches != 1 {
		t.Errorf("%d audits, %d mismatches; want 2 and 1", sink.audits, sink.mismatches)
	}
}

// dropOnce loses the first delivery of one key, as a bug would.
type dropOnce struct {
	*hostSink
	drop               string
	dropped            atomic.Bool
	audits, mismatches int // settle's goroutine only
}

func (d *dropOnce) Set(key string, hosts []nametable.Host) error {
	if key == d.drop && d.dropped.CompareAndSwap(false, true) {
		return nil
	}
	return d.hostSink.Set(key, hosts)
}

func (d *dropOnce) Audit(expected int) error {
	d.audits++
	err := d.hostSink.Audit(expected)
	if err != nil {
		d.mismatches++
	}
	return err
}
