package nametable

import (
	"encoding/binary"
	"hash/maphash"
	"maps"
	"net/netip"
)

// shardBits sets the number of shards of every table map. An update copies
// only the shards it touches, so a change to one host of a 100k-host table
// copies about 1/256 of it.
const (
	shardBits = 8
	nShards   = 1 << shardBits
)

var seed = maphash.MakeSeed()

func hashString(s string) uint64 { return maphash.String(seed, s) }

func hashAddr(a netip.Addr) uint64 {
	b := a.As16()
	x := binary.LittleEndian.Uint64(b[:8])*0x9e3779b97f4a7c15 ^ binary.LittleEndian.Uint64(b[8:])
	x ^= x >> 29
	x *= 0xbf58476d1ce4e5b9
	return x ^ x>>32
}

// smap is an immutable sharded map: readers look up without locks; a writer
// (see smapWriter) produces a new smap that shares every untouched shard
// with the old one.
type smap[K string | netip.Addr, V any] struct {
	shards *[nShards]map[K]V
	n      int
}

func newSmap[K string | netip.Addr, V any]() smap[K, V] {
	return smap[K, V]{shards: new([nShards]map[K]V)}
}

// shard picks the shard of k. A type switch, not a func value: the key
// (often a string in a stack buffer) must not escape.
func (m *smap[K, V]) shard(k K) int {
	var h uint64
	switch k := any(k).(type) {
	case string:
		h = hashString(k)
	case netip.Addr:
		h = hashAddr(k)
	}
	return int(h >> (64 - shardBits))
}

func (m *smap[K, V]) get(k K) (V, bool) {
	v, ok := m.shards[m.shard(k)][k]
	return v, ok
}

// len is the number of entries.
func (m *smap[K, V]) len() int { return m.n }

// each calls fn for every entry, in no particular order, until it returns false.
func (m *smap[K, V]) each(fn func(K, V) bool) {
	for _, s := range m.shards {
		for k, v := range s {
			if !fn(k, v) {
				return
			}
		}
	}
}

// smapWriter changes a copy of an smap in place: the first write to a shard
// copies that shard, later writes in the same batch reuse the copy.
type smapWriter[K string | netip.Addr, V any] struct {
	m     smap[K, V]
	owned [nShards]bool
}

// begin starts a batch on top of m (which stays unchanged).
func (w *smapWriter[K, V]) begin(m smap[K, V]) {
	shards := *m.shards
	w.m = smap[K, V]{shards: &shards, n: m.n}
	w.owned = [nShards]bool{}
}

func (w *smapWriter[K, V]) own(i int) map[K]V {
	if !w.owned[i] {
		old := w.m.shards[i]
		if old == nil {
			w.m.shards[i] = make(map[K]V)
		} else {
			w.m.shards[i] = maps.Clone(old)
		}
		w.owned[i] = true
	}
	return w.m.shards[i]
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
	if _, ok := w.m.shards[i][k]; !ok {
		return
	}
	delete(w.own(i), k)
	w.m.n--
}
