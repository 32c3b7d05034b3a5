package nametable

import (
	"encoding/binary"
	"hash/maphash"
	"maps"
	"net/netip"
)

// An smap has nShards shards in two levels (nTop groups of nLeaf maps).
// An update copies only the shards it touches and the groups holding
// them: a change to one host of a 100k-host table copies a few maps of
// tens to a hundred entries and a few 512-byte groups
// (BenchmarkUpdateOne100k: ~12 KB), so the garbage one API event leaves is
// small and collecting close to the live heap stays cheap.
const (
	topBits  = 6
	leafBits = 6
	nTop     = 1 << topBits
	nLeaf    = 1 << leafBits
	nShards  = nTop * nLeaf
)

var seed = maphash.MakeSeed()

func hashString(s string) uint64 { return maphash.String(seed, s) }

// addrKey is an address as a map key: its 16 bytes (an IPv4 address in its
// v4-mapped form). Unlike netip.Addr (24 bytes, with a pointer for the
// zone), it has no pointer, so the collector does not scan the reverse
// index's keys, and a map slot is 8 bytes smaller.
type addrKey [16]byte

func keyOf(a netip.Addr) addrKey { return a.As16() }

func hashAddr(b addrKey) uint64 {
	x := binary.LittleEndian.Uint64(b[:8])*0x9e3779b97f4a7c15 ^ binary.LittleEndian.Uint64(b[8:])
	x ^= x >> 29
	x *= 0xbf58476d1ce4e5b9
	return x ^ x>>32
}

// smap is an immutable sharded map: readers look up without locks; a writer
// (see smapWriter) produces a new smap that shares every untouched shard
// and group with the old one.
type smap[K string | addrKey, V any] struct {
	groups *[nTop]*[nLeaf]map[K]V
	n      int
}

func newSmap[K string | addrKey, V any]() smap[K, V] {
	var m smap[K, V]
	m.groups = new([nTop]*[nLeaf]map[K]V)
	for i := range m.groups {
		m.groups[i] = new([nLeaf]map[K]V)
	}
	return m
}

// shard picks the shard of k. A type switch, not a func value: the key
// (often a string in a stack buffer) must not escape.
func (m *smap[K, V]) shard(k K) int {
	var h uint64
	switch k := any(k).(type) {
	case string:
		h = hashString(k)
	case addrKey:
		h = hashAddr(k)
	}
	return int(h >> (64 - topBits - leafBits))
}

// at is shard i's map (nil when empty).
func (m *smap[K, V]) at(i int) map[K]V { return m.groups[i>>leafBits][i&(nLeaf-1)] }

func (m *smap[K, V]) get(k K) (V, bool) {
	v, ok := m.at(m.shard(k))[k]
	return v, ok
}

// len is the number of entries.
func (m *smap[K, V]) len() int { return m.n }

// each calls fn for every entry, in no particular order, until it returns false.
func (m *smap[K, V]) each(fn func(K, V) bool) {
	for _, g := range m.groups {
		for _, s := range g {
			for k, v := range s {
				if !fn(k, v) {
					return
				}
			}
		}
	}
}

// smapWriter changes a copy of an smap in place: the first write to a shard
// copies that shard (and its group), later writes in the same batch reuse
// the copies.
type smapWriter[K string | addrKey, V any] struct {
	m          smap[K, V]
	ownedGroup [nTop]bool
	ownedShard [nShards]bool
}

// begin starts a batch on top of m (which stays unchanged).
func (w *smapWriter[K, V]) begin(m smap[K, V]) {
	groups := *m.groups
	w.m = smap[K, V]{groups: &groups, n: m.n}
	w.ownedGroup = [nTop]bool{}
	w.ownedShard = [nShards]bool{}
}

func (w *smapWriter[K, V]) own(i int) map[K]V {
	g, l := i>>leafBits, i&(nLeaf-1)
	if !w.ownedGroup[g] {
		group := *w.m.groups[g]
		w.m.groups[g] = &group
		w.ownedGroup[g] = true
	}
	group := w.m.groups[g]
	if !w.ownedShard[i] {
		if old := group[l]; old == nil {
			group[l] = make(map[K]V)
		} else {
			group[l] = maps.Clone(old)
		}
		w.ownedShard[i] = true
	}
	return group[l]
}

func (w *smapWriter[K, V]) get(k K) (V, bool) { return w.m.get(k) }

func (w *smapWriter[K, V]) set(k K, v V) {
	s := w.own(w.m.shard(k))
	if _, ok := s[k]; !ok {
		w.m.n++
	}
	s[k] = v
}

func (w *smapWriter[K, V]) del(k K) {
	i := w.m.shard(k)
	if _, ok := w.m.at(i)[k]; !ok {
		return
	}
	delete(w.own(i), k)
	w.m.n--
}
