package upstream

import "sync"

// Per-workload shares of the cache. Each answer a miss brings into the cache is
// charged to the workload whose miss fetched it (Query.Owner), and a workload's
// charged bytes are capped (Config.CacheWorkloadBytes): over its share, its own
// oldest entries are evicted, never another workload's. So one workload asking
// thousands of distinct names a second (random names through a search path) keeps
// at most its share of the cache and of the agent's memory, as its upstream budget
// keeps it to its share of the upstream.

// shareLink is an entry's place in its owner's list, under shares.mu.
type shareLink struct {
	prev, next *entry
	charged    bool // in its owner's list, its bytes counted
	gone       bool // out of the cache (evicted, replaced, or over its owner's share)
	size       int  // the bytes charged
}

// ownerUse is one workload's charged entries, oldest first.
type ownerUse struct {
	bytes      int
	head, tail *entry
}

// shares accounts the cache's bytes per owner. Lock order: a shard's mu, then
// shares.mu.
type shares struct {
	mu      sync.Mutex
	cap     int // bytes per owner; 0 = no cap (nothing is accounted)
	owners  map[uint64]*ownerUse
	evicted uint64 // entries evicted because their owner was over its share, under mu
}

func newShares(capBytes int) *shares {
	return &shares{cap: max(capBytes, 0), owners: make(map[uint64]*ownerUse)}
}

// charge adds e (just stored) to its owner's list and returns the owner's oldest
// entries that put it over its share: they are already uncounted and marked gone,
// and the caller removes them from their shards. e itself is never one of them
// (put does not store an entry larger than a share).
func (s *shares) charge(e *entry, size int) []*entry {
	if s.cap == 0 || e.owner == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.share.gone { // evicted before it was charged
		return nil
	}
	u := s.owners[e.owner]
	if u == nil {
		u = &ownerUse{}
		s.owners[e.owner] = u
	}
	e.share.charged, e.share.size = true, size
	e.share.prev = u.tail
	if u.tail != nil {
		u.tail.share.next = e
	} else {
		u.head = e
	}
	u.tail = e
	u.bytes += size
	var victims []*entry
	for u.bytes > s.cap && u.head != e {
		v := u.head
		s.unlink(u, v)
		v.share.gone = true
		victims = append(victims, v)
	}
	s.evicted += uint64(len(victims))
	return victims
}

// uncharge is called for an entry leaving the cache (evicted, replaced): its owner
// is no longer charged for it.
func (s *shares) uncharge(e *entry) {
	if s.cap == 0 || e.owner == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e.share.gone {
		return
	}
	e.share.gone = true
	if !e.share.charged {
		return
	}
	if u := s.owners[e.owner]; u != nil {
		s.unlink(u, e)
		if u.head == nil {
			delete(s.owners, e.owner)
		}
	}
}

// unlink takes e out of u's list and its bytes out of u's, under mu.
func (s *shares) unlink(u *ownerUse, e *entry) {
	l := &e.share
	if l.prev != nil {
		l.prev.share.next = l.next
	} else {
		u.head = l.next
	}
	if l.next != nil {
		l.next.share.prev = l.prev
	} else {
		u.tail = l.prev
	}
	l.prev, l.next, l.charged = nil, nil, false
	u.bytes -= l.size
}

// evictions is how many entries left the cache because their owner was over its share.
func (s *shares) evictions() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.evicted
}

// owned is the bytes charged to owner.
func (s *shares) owned(owner uint64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if u := s.owners[owner]; u != nil {
		return u.bytes
	}
	return 0
}
