package kubesource

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"

	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// serviceWorkers recompute Services in parallel (never one key twice at
// once): the initial lists of a large cluster are turned into hosts on
// both cores, as the two informers' handler goroutines did before.
const serviceWorkers = 2

// services turns what two informers hold, the Services and the
// EndpointSlices, into each Service's hosts. The informers' handlers only
// record a change (the slice index, then the key in the queue); workers
// recompute each queued key from the informers' current state. A handler
// that computed hosts itself could read a Service's absence, be overtaken
// by the Service informer's handler, and then overwrite that Service's
// hosts with nothing: a Service missing from the table until it next
// changed.
type services struct {
	domain string
	store  cache.Store // the Service informer's (GetByKey)
	slices *sliceIndex
	sink   names.Sink
	log    *slog.Logger
	queue  *keyQueue

	// seen counts the Services the Service handler was told of (adds
	// minus deletes). The informer's store changes before its handler
	// runs: while the two counts differ, a Service event is on its way.
	seen atomic.Int64

	mu       sync.Mutex
	rejected map[string]bool // keys whose last hosts the store refused
}

func newServices(domain string, store cache.Store, sink names.Sink, log *slog.Logger) *services {
	return &services{
		domain: domain, store: store, sink: sink, log: log, queue: newKeyQueue(),
		slices:   &sliceIndex{m: map[string][]*endpointSlice{}},
		rejected: map[string]bool{},
	}
}

// serviceHandler is the Service informer's handler.
func (r *services) serviceHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			r.seen.Add(1)
			r.queue.add(keyOf(obj))
		},
		UpdateFunc: func(_, obj any) { r.queue.add(keyOf(obj)) },
		DeleteFunc: func(obj any) {
			r.seen.Add(-1)
			r.queue.add(keyOf(obj))
		},
	}
}

// sliceHandler is the EndpointSlice informer's handler: the index first,
// then the key, so the recomputation that follows sees the change.
func (r *services) sliceHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			k := sliceService(obj)
			r.slices.set(k, obj)
			r.queue.add(k)
		},
		UpdateFunc: func(old, obj any) {
			if k := sliceService(old); k != sliceService(obj) && k != "" {
				r.slices.remove(k, old) // the slice moved to another Service
				r.queue.add(k)
			}
			k := sliceService(obj)
			r.slices.set(k, obj)
			r.queue.add(k)
		},
		DeleteFunc: func(obj any) {
			k := sliceService(obj)
			r.slices.remove(k, obj)
			r.queue.add(k)
		},
	}
}

// sliceService is the "<namespace>/<service>" key of a slice's Service.
func sliceService(obj any) string {
	if es, ok := unwrap(obj).(*endpointSlice); ok && es.service != "" {
		return es.Namespace + "/" + es.service
	}
	return ""
}

// run recomputes queued keys until ctx ends.
func (r *services) run(ctx context.Context) {
	var wg sync.WaitGroup
	for range serviceWorkers {
		wg.Go(func() {
			for {
				key, ok := r.queue.get()
				if !ok {
					return
				}
				r.recompute(key)
				r.queue.done(key)
			}
		})
	}
	<-ctx.Done()
	r.queue.stop()
	wg.Wait()
}

// recompute delivers one Service's hosts (none once it is gone), computed
// from the informers' state as it is now.
func (r *services) recompute(key string) {
	obj, ok, _ := r.store.GetByKey(key)
	svc, _ := obj.(*service)
	if !ok || svc == nil {
		r.note(key, r.sink.Set(key, nil))
		return
	}
	err := r.sink.Set(key, serviceHosts(r.domain, svc, r.slices.of(key)))
	if err != nil {
		r.log.Warn("service not answered", "service", key, "err", err)
	}
	r.note(key, err)
}

func (r *services) note(key string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		r.rejected[key] = true
	} else {
		delete(r.rejected, key)
	}
}

// settle waits until every Service event has reached the handler and
// every queued change is delivered, then audits the store's count against
// the informer's (names.Sink.Audit). After a mismatch it queues every
// Service again and audits once more, up to names.MaxAudits times. It
// returns false when ctx ended first.
func (r *services) settle(ctx context.Context) bool {
	for audits := 0; ; {
		want, ok := r.quiet(ctx)
		if !ok {
			return false
		}
		err := r.sink.Audit(want)
		if err == nil {
			return true
		}
		if audits++; audits == names.MaxAudits {
			r.log.Error("name table still differs from the API server after recomputing every Service", "audits", audits, "err", err)
			return true
		}
		for _, key := range r.store.ListKeys() {
			r.queue.add(key)
		}
	}
}

// quiet waits for a moment when no change is queued or being delivered and
// no Service event is on its way to the handler, and returns the number of
// Services the store should hold then.
func (r *services) quiet(ctx context.Context) (int, bool) {
	for {
		if !r.queue.idle(ctx) {
			return 0, false
		}
		n := r.queue.added()
		want, held := r.expected()
		if held == r.seen.Load() && r.queue.added() == n {
			return want, true
		}
		// An event is on its way: its handler adds a key.
		if !r.queue.waitAdded(ctx, n) {
			return 0, false
		}
	}
}

// expected counts the Services of the informer's store the store did not
// refuse (want; every Service has hosts: a headless one without ready
// endpoints has its name with no addresses), and all of them (held).
func (r *services) expected() (want int, held int64) {
	keys := r.store.ListKeys()
	r.mu.Lock()
	defer r.mu.Unlock()
	want = len(keys)
	for key := range r.rejected {
		if _, ok, _ := r.store.GetByKey(key); ok {
			want--
		}
	}
	return want, int64(len(keys))
}

// sliceIndex is the EndpointSlices of each Service.
type sliceIndex struct {
	mu sync.Mutex
	m  map[string][]*endpointSlice // "<ns>/<service>" -> its slices
}

func (x *sliceIndex) of(svc string) []*endpointSlice {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.m[svc] // never modified in place: copied on change
}

// set adds or replaces (by name) a slice of svc.
func (x *sliceIndex) set(svc string, obj any) { x.change(svc, obj, true) }

// remove drops a slice (by name) from svc.
func (x *sliceIndex) remove(svc string, obj any) { x.change(svc, obj, false) }

// change replaces svc's list by a copy without the slice obj names, plus obj
// when keep; a Service left without slices leaves the index.
func (x *sliceIndex) change(svc string, obj any, keep bool) {
	es, ok := unwrap(obj).(*endpointSlice)
	if !ok || svc == "" {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	extra := 0
	if keep {
		extra = 1
	}
	next := without(x.m[svc], es.Name, extra)
	if keep {
		next = append(next, es)
	}
	if len(next) > 0 {
		x.m[svc] = next
	} else {
		delete(x.m, svc)
	}
}

// without copies cur without the slice named name, with room for extra
// more (the index's lists are never changed in place).
func without(cur []*endpointSlice, name string, extra int) []*endpointSlice {
	next := make([]*endpointSlice, 0, len(cur)+extra)
	for _, c := range cur {
		if c.Name != name {
			next = append(next, c)
		}
	}
	return next
}
