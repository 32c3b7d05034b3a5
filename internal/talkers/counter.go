// Package talkers counts queries per workload and exports the top talkers
// with bounded cardinality: the top K workloads by queries, by NXDOMAIN
// answers and by unanswered queries over a sliding window, each with one
// "(other)" series for the rest, and (optionally) per-namespace counters up to
// a hard cap. The number of series never depends on how many workloads there
// are beyond K and the cap.
//
// The query path counts into a fixed table with atomic operations (no lock,
// no allocation). Every Period the table is swapped for an empty one; the
// previous one is read a Period later (when no query can still be counting
// into it) into the window, which holds the last Window/Period periods.
package talkers

import (
	"net/netip"
	"sync/atomic"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// tableSlots is how many workloads one period's table holds; the rest of a
// period's workloads are counted as "(other)". A power of two.
const tableSlots = 4096

// probes is how far an insert looks for a free slot.
const probes = 16

// slot is one workload's counts in one period.
type slot struct {
	id         atomic.Uint64 // Key.ID; 0: free
	pid        atomic.Uint32
	addrHi     atomic.Uint64 // the key's address (for an address key)
	addrLo     atomic.Uint64
	queries    atomic.Uint64
	nxdomain   atomic.Uint64
	unanswered atomic.Uint64
}

// table is one period's counts.
type table struct {
	slots    [tableSlots]slot
	overflow slot // workloads that found no free slot
}

// count adds one query of k to t; it reports whether k is new in t.
func (t *table) count(k workload.Key, nxdomain, unanswered bool) bool {
	id := k.ID()
	h := id * 0x9e3779b97f4a7c15
	h ^= h >> 29
	s, isNew := &t.overflow, false
	for i := range uint64(probes) {
		c := &t.slots[(h+i)&(tableSlots-1)]
		cur := c.id.Load()
		if cur == id {
			s = c
			break
		}
		if cur == 0 && c.id.CompareAndSwap(0, id) {
			s, isNew = c, true
			a := k.Addr.As16()
			c.addrHi.Store(beUint64(a[:8]))
			c.addrLo.Store(beUint64(a[8:]))
			break
		}
		if c.id.Load() == id { // another thread inserted id meanwhile
			s = c
			break
		}
	}
	if k.PID != 0 && s.pid.Load() != k.PID {
		s.pid.Store(k.PID)
	}
	s.queries.Add(1)
	if nxdomain {
		s.nxdomain.Add(1)
	}
	if unanswered {
		s.unanswered.Add(1)
	}
	return isNew
}

func beUint64(b []byte) uint64 {
	var v uint64
	for _, x := range b {
		v = v<<8 | uint64(x)
	}
	return v
}

// key rebuilds the Key of a slot.
func (s *slot) key() workload.Key {
	id := s.id.Load()
	k := workload.Key{PID: s.pid.Load()}
	if id&(1<<63) == 0 {
		k.Cgroup = id
		return k
	}
	var a [16]byte
	hi, lo := s.addrHi.Load(), s.addrLo.Load()
	for i := range 8 {
		a[i] = byte(hi >> (56 - 8*i))
		a[8+i] = byte(lo >> (56 - 8*i))
	}
	if ad := netip.AddrFrom16(a).Unmap(); ad.IsValid() && !ad.IsUnspecified() {
		k.Addr = ad
	}
	return k
}

func (s *slot) reset() {
	s.id.Store(0)
	s.pid.Store(0)
	s.addrHi.Store(0)
	s.addrLo.Store(0)
	s.queries.Store(0)
	s.nxdomain.Store(0)
	s.unanswered.Store(0)
}

// Counts are one workload's counts.
type Counts struct{ Queries, NXDomain, Unanswered uint64 }

func (c *Counts) add(o Counts) {
	c.Queries += o.Queries
	c.NXDomain += o.NXDomain
	c.Unanswered += o.Unanswered
}

// harvest reads t into m (by key; overflow under the zero Key's "(other)"
// marker) and clears it.
func (t *table) harvest(m map[workload.Key]Counts, other *Counts) {
	for i := range t.slots {
		s := &t.slots[i]
		if s.id.Load() == 0 {
			continue
		}
		k := s.key()
		c := m[k]
		c.add(Counts{s.queries.Load(), s.nxdomain.Load(), s.unanswered.Load()})
		m[k] = c
		s.reset()
	}
	other.add(Counts{t.overflow.queries.Load(), t.overflow.nxdomain.Load(), t.overflow.unanswered.Load()})
	t.overflow.reset()
}

// Counter is what the query path counts into.
type Counter struct {
	cur   atomic.Pointer[table]
	learn func(workload.Key) // told of each key new in a period (workload.Namer.Learn)
}

// Count counts one answered query of k. nxdomain: the answer was NXDOMAIN;
// unanswered: the client got no answer in time (shed or upstream failure).
func (c *Counter) Count(k workload.Key, nxdomain, unanswered bool) {
	if c == nil {
		return
	}
	if c.cur.Load().count(k, nxdomain, unanswered) && c.learn != nil {
		c.learn(k)
	}
}
