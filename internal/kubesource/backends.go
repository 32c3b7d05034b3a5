package kubesource

import (
	"net/netip"
	"slices"
	"strings"
	"sync"

	"k8s.io/client-go/tools/cache"
)

// backendWatch reports the endpoint addresses of one Service (the cluster DNS
// Service's CoreDNS pods) from the source's EndpointSlice informer, for the
// datapath's capture after another datapath's translation.
type backendWatch struct {
	mu        sync.Mutex
	namespace string
	name      string
	fn        func([]netip.Addr)
	store     cache.Store // the EndpointSlice informer's, once Run made it
	last      []netip.Addr
	reported  bool
}

// WatchServiceBackends calls fn with the addresses of every endpoint of the
// Service ns/name (ready or not, sorted, no duplicates) now, if the source
// runs, and whenever they change. One watch per source; a later call
// replaces the earlier one.
func (s *Source) WatchServiceBackends(service string, fn func([]netip.Addr)) {
	ns, name, _ := strings.Cut(service, "/")
	b := &s.backends
	b.mu.Lock()
	defer b.mu.Unlock()
	b.namespace, b.name, b.fn, b.reported = ns, name, fn, false
	b.reportLocked()
}

// setStore gives the watch the informer's store (Run); its events report.
func (b *backendWatch) setStore(store cache.Store) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.store = store
}

// changed is the slice informer's event: obj's Service may have new backends.
func (b *backendWatch) changed(obj any) {
	s, ok := unwrap(obj).(*endpointSlice)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fn == nil || (ok && (s.Namespace != b.namespace || s.service != b.name)) {
		return
	}
	b.reportLocked()
}

func (b *backendWatch) reportLocked() {
	if b.fn == nil || b.store == nil {
		return
	}
	var addrs []netip.Addr
	for _, obj := range b.store.List() {
		s, ok := obj.(*endpointSlice)
		if !ok || s.Namespace != b.namespace || s.service != b.name {
			continue
		}
		for _, e := range s.endpoints {
			addrs = append(addrs, e.addrs...)
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	addrs = slices.Compact(addrs)
	// Nothing before the first backend: the informer may not have listed
	// yet, and the datapath keeps a predecessor's backends until then.
	if b.reported && slices.Equal(addrs, b.last) || !b.reported && len(addrs) == 0 {
		return
	}
	b.last, b.reported = addrs, true
	b.fn(addrs)
}

// handler is the slice informer's event handler of the watch.
func (b *backendWatch) handler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { b.changed(obj) },
		UpdateFunc: func(_, obj any) { b.changed(obj) },
		DeleteFunc: func(obj any) { b.changed(obj) },
	}
}
