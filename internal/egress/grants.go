package egress

import (
	"container/heap"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// ErrFull is returned by Grant when the grant map is at its cap, nothing in it
// has expired, and the workload holds no grant it could give up: another
// workload's live grants are never evicted.
var ErrFull = errors.New("egress grant map full")

// ErrTooManyPorts is returned by Grant when an address would need more
// (port, protocol) pairs than a grant holds; its grant is left as it was.
var ErrTooManyPorts = fmt.Errorf("more than %d ports for one address", redirect.EgressPorts)

// grantStore is where grants are written: the egress_grants map (a fake in the
// bookkeeping tests).
type grantStore interface {
	Put(k *redirect.EgressGrantKey, v *redirect.EgressGrant) error
	Delete(k *redirect.EgressGrantKey) error
}

type mapStore struct{ m *ebpf.Map }

func (s mapStore) Put(k *redirect.EgressGrantKey, v *redirect.EgressGrant) error {
	return s.m.Put(k, v)
}

func (s mapStore) Delete(k *redirect.EgressGrantKey) error {
	if err := s.m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return err
	}
	return nil
}

// Grants writes the resolver's grants into the grant map, within its cap and
// each workload's quota. When a new grant finds its workload at quota, the
// workload's grant closest to expiry gives way (an expired one first, since it
// is closest). When it finds the map at its cap, an expired grant of any
// workload gives way, else the workload's own grant closest to expiry, else
// the grant is refused (ErrFull): a workload's flood never evicts another
// workload's live grants. Safe for concurrent use; a refresh of a grant it
// holds, or a new one once the bookkeeping has grown, allocates nothing.
type Grants struct {
	mu    sync.Mutex
	store grantStore
	limit int // the map's max_entries
	quota int
	grace time.Duration
	now   func() int64

	byKey map[redirect.EgressGrantKey]*grant
	wls   map[WorkloadID]*wlGrants
	total int
	free  []*grant
	val   redirect.EgressGrant // scratch value, under mu
}

type grant struct {
	key redirect.EgressGrantKey
	val redirect.EgressGrant
	idx int // in its workload's heap
}

// wlGrants is one workload's grants, a min-heap by expiry.
type wlGrants []*grant

func (h wlGrants) Len() int           { return len(h) }
func (h wlGrants) Less(i, j int) bool { return h[i].val.Expiry < h[j].val.Expiry }
func (h wlGrants) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx = i
	h[j].idx = j
}
func (h *wlGrants) Push(x any) {
	g := x.(*grant)
	g.idx = len(*h)
	*h = append(*h, g)
}
func (h *wlGrants) Pop() any {
	old := *h
	g := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return g
}

func newGrants(store grantStore, limit, quota int, grace time.Duration, now func() int64) *Grants {
	return &Grants{store: store, limit: limit, quota: min(quota, limit), grace: grace, now: now,
		byKey: map[redirect.EgressGrantKey]*grant{}, wls: map[WorkloadID]*wlGrants{}}
}

// Grant allows workload wl to connect to each of addrs on ports (none: any
// port and protocol) until ttl plus the grace from now, because name resolved
// to them. Call it before the answer leaves: a client cannot connect before
// its grant is in the map. A grant the workload already holds for an address
// is extended (never shortened) and its ports joined. It returns the first
// error; the other addresses are still granted.
func (g *Grants) Grant(wl WorkloadID, name string, addrs []netip.Addr, ports []Port, ttl time.Duration) error {
	if wl == 0 {
		return fmt.Errorf("egress: grant %s: workload 0", name)
	}
	if len(ports) > redirect.EgressPorts {
		return fmt.Errorf("egress: grant %s: %w", name, ErrTooManyPorts)
	}
	if ttl < 0 {
		ttl = 0
	}
	var first error
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	expiry := uint64(now + int64(ttl+g.grace))
	for _, a := range addrs {
		if err := g.grantOne(wl, a, ports, expiry, uint64(now)); err != nil && first == nil {
			first = fmt.Errorf("egress: grant %s (%s) to workload %d: %w", name, a, wl, err)
		}
	}
	return first
}

// grantOne grants one address, g.mu held.
func (g *Grants) grantOne(wl WorkloadID, a netip.Addr, ports []Port, expiry, now uint64) error {
	key := redirect.EgressGrantKey{Workload: uint32(wl), Addr: addrWords(a)}
	if old := g.byKey[key]; old != nil {
		g.val = old.val
		if !merge(&g.val, ports, expiry, now) {
			return ErrTooManyPorts
		}
		if g.val == old.val {
			return nil // nothing new: no write
		}
		if err := g.store.Put(&old.key, &g.val); err != nil {
			return err
		}
		old.val = g.val
		heap.Fix(g.wls[wl], old.idx)
		return nil
	}
	h := g.wls[wl]
	if h == nil {
		h = &wlGrants{}
		g.wls[wl] = h
	}
	if err := g.makeRoom(h, now); err != nil {
		return err
	}
	n := g.alloc()
	n.key = key
	n.val = redirect.EgressGrant{}
	merge(&n.val, ports, expiry, now)
	if err := g.store.Put(&n.key, &n.val); err != nil {
		g.free = append(g.free, n)
		return err
	}
	heap.Push(h, n)
	g.byKey[n.key] = n
	g.total++
	return nil
}

// merge joins ports and expiry into v (an expired v is replaced); false when
// the ports do not fit.
func merge(v *redirect.EgressGrant, ports []Port, expiry, now uint64) bool {
	live := v.Expiry > now
	if !live {
		v.Nports = 0
		v.Ports = [len(v.Ports)]redirect.EgressPort{}
	}
	switch {
	case live && v.Nports == 0:
		// any port already
	case len(ports) == 0 || hasAny(ports):
		v.Nports = 0
		v.Ports = [len(v.Ports)]redirect.EgressPort{}
	default:
		next := *v
		for _, p := range ports {
			if !contains(&next, p) {
				if int(next.Nports) == len(next.Ports) {
					return false
				}
				next.Ports[next.Nports] = redirect.EgressPort{Port: p.Port, Proto: uint8(p.Proto)}
				next.Nports++
			}
		}
		*v = next
	}
	if expiry > v.Expiry {
		v.Expiry = expiry
	}
	return true
}

func hasAny(ports []Port) bool {
	for _, p := range ports {
		if p.Port == 0 && p.Proto == ProtoAny {
			return true
		}
	}
	return false
}

func contains(v *redirect.EgressGrant, p Port) bool {
	for i := range v.Nports {
		if v.Ports[i].Port == p.Port && v.Ports[i].Proto == uint8(p.Proto) {
			return true
		}
	}
	return false
}

// makeRoom frees a place for one more grant of h's workload, g.mu held.
func (g *Grants) makeRoom(h *wlGrants, now uint64) error {
	if h.Len() >= g.quota {
		return g.evict(h) // its closest to expiry: an expired one if it has any
	}
	if g.total < g.limit {
		return nil
	}
	for _, o := range g.wls {
		if o.Len() > 0 && (*o)[0].val.Expiry <= now {
			return g.evict(o)
		}
	}
	if h.Len() > 0 {
		return g.evict(h)
	}
	return ErrFull
}

// evict removes h's grant closest to expiry, g.mu held.
func (g *Grants) evict(h *wlGrants) error {
	o := (*h)[0]
	if err := g.store.Delete(&o.key); err != nil {
		return fmt.Errorf("evict a grant: %w", err)
	}
	heap.Pop(h)
	g.drop(o)
	return nil
}

// drop forgets o, already out of its heap and the map.
func (g *Grants) drop(o *grant) {
	delete(g.byKey, o.key)
	g.total--
	g.free = append(g.free, o)
}

func (g *Grants) alloc() *grant {
	if n := len(g.free); n > 0 {
		o := g.free[n-1]
		g.free = g.free[:n-1]
		return o
	}
	return &grant{}
}

// Sweep removes every expired grant and returns how many it removed.
func (g *Grants) Sweep() (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := uint64(g.now())
	n := 0
	for wl, h := range g.wls {
		for h.Len() > 0 && (*h)[0].val.Expiry <= now {
			if err := g.evict(h); err != nil {
				return n, err
			}
			n++
		}
		if h.Len() == 0 {
			delete(g.wls, wl)
		}
	}
	return n, nil
}

// Len is how many grants are held, and how many of them wl holds.
func (g *Grants) Len(wl WorkloadID) (total, workload int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if h := g.wls[wl]; h != nil {
		workload = h.Len()
	}
	return g.total, workload
}

// Limits are the grant cap and the per-workload quota.
func (g *Grants) Limits() (limit, quota int) { return g.limit, g.quota }

// removeWorkload drops every grant of wl.
func (g *Grants) removeWorkload(wl WorkloadID) {
	g.mu.Lock()
	defer g.mu.Unlock()
	h := g.wls[wl]
	if h == nil {
		return
	}
	for _, o := range *h {
		_ = g.store.Delete(&o.key)
		g.drop(o)
	}
	delete(g.wls, wl)
}

// adopt takes the grants a previous agent left in m into the bookkeeping,
// removing the expired ones. Returns how many it kept and removed.
func (g *Grants) adopt(m *ebpf.Map) (kept, removed int, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := uint64(g.now())
	var (
		k    redirect.EgressGrantKey
		v    redirect.EgressGrant
		gone []redirect.EgressGrantKey
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		if v.Expiry <= now || k.Workload == 0 {
			gone = append(gone, k)
			continue
		}
		wl := WorkloadID(k.Workload)
		h := g.wls[wl]
		if h == nil {
			h = &wlGrants{}
			g.wls[wl] = h
		}
		n := &grant{key: k, val: v}
		heap.Push(h, n)
		g.byKey[k] = n
		g.total++
	}
	if err := it.Err(); err != nil {
		return kept, removed, err
	}
	for i := range gone {
		if err := g.store.Delete(&gone[i]); err != nil {
			return g.total, removed, err
		}
		removed++
	}
	return g.total, removed, nil
}
