package upstream

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"
)

// hashKey is FNV-1a over the ASCII-lower-cased name, type, class and flags. It does not
// allocate, so a cache hit never lower-cases a string.
func hashKey(name string, qtype, qclass uint16, flags uint8) uint64 {
	const (
		offset = 14695981039346656037
		prime  = 1099511628211
	)
	h := uint64(offset)
	for i := 0; i < len(name); i++ {
		c := name[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		h ^= uint64(c)
		h *= prime
	}
	for _, b := range [5]byte{byte(qtype >> 8), byte(qtype), byte(qclass >> 8), byte(qclass), flags} {
		h ^= uint64(b)
		h *= prime
	}
	return h
}

// equalFoldASCII compares a query name with a lower-cased key name.
func equalFoldASCII(name, lower string) bool {
	if len(name) != len(lower) {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != lower[i] {
			return false
		}
	}
	return true
}

func (k *cacheKey) matches(name string, qtype, qclass uint16, flags uint8) bool {
	return k.qtype == qtype && k.qclass == qclass && k.flags == flags && equalFoldASCII(name, k.name)
}

// shard is one part of the cache: a map changed in place under its lock. A hit takes
// the lock shared; an insert takes it alone for a map write and, in a full shard, a
// few sampled entries' eviction. (It was copy-on-write, for a lock-free hit: each
// insert then copied the shard's map, some 1,500 entries at the default size, and the
// garbage of the copies set the pace of the collector; BenchmarkCacheInsertFull.)
type shard struct {
	mu    sync.RWMutex
	m     map[uint64]*entry
	cap   int      // entries
	bytes int      // sum of entry sizes, under mu
	_     [64]byte // against false sharing between shards
}

// cache is a sharded map of entries bounded in entries and in bytes (each shard gets an
// equal part of both). Eviction picks, among a few random samples of a full shard, the
// entry whose stale window ends first. Each workload's entries are bounded too
// (shares, share.go): over its share, its own oldest go first.
type cache struct {
	shares     *shares
	shards     []shard
	mask       uint64
	shardBytes int
	entries    atomic.Int64
	bytes      atomic.Int64
	evicted    atomic.Uint64
	tooBig     atomic.Uint64
	stale      int64 // stale window in nanoseconds, for eviction preference
}

const (
	minShards       = 16
	maxShards       = 1 << 16
	entriesPerShard = 32        // target shard size, which bounds the copy per insert
	minShardBytes   = 256 << 10 // a shard holds at least one large (64 KiB) TCP answer
)

// newCache makes a cache of size entries and maxBytes, each owner's entries capped
// at workloadBytes (0: no cap).
func newCache(size, maxBytes, workloadBytes int, stale time.Duration) *cache {
	n := minShards
	for n < maxShards && size/n > entriesPerShard && maxBytes/(2*n) >= minShardBytes {
		n *= 2
	}
	if size < n {
		// Small caches: fewer shards so that each holds at least one entry.
		n = 1 << (bits.Len(uint(max(size, 1))) - 1)
	}
	c := &cache{shards: make([]shard, n), mask: uint64(n - 1), shardBytes: max(maxBytes/n, 1), stale: int64(max(stale, 0)),
		shares: newShares(workloadBytes)}
	for i := range c.shards {
		per := size / n // the capacities add up to size exactly
		if i < size%n {
			per++
		}
		c.shards[i].m = make(map[uint64]*entry)
		c.shards[i].cap = max(per, 1)
	}
	return c
}

func (c *cache) shard(h uint64) *shard { return &c.shards[(h>>32^h)&c.mask] }

// get returns the entry for the query key, or nil.
func (c *cache) get(h uint64, name string, qtype, qclass uint16, flags uint8) *entry {
	s := c.shard(h)
	s.mu.RLock()
	e := s.m[h]
	s.mu.RUnlock()
	if e == nil || !e.key.matches(name, qtype, qclass, flags) {
		return nil
	}
	return e
}

// put stores e, replacing an older entry of the same key (or a hash collision) and
// evicting entries while the shard is over its entry or byte budget, then charges e to
// its owner, whose oldest entries leave while it is over its share. An entry larger
// than a shard's byte budget, or than a workload's share, is not stored.
func (c *cache) put(e *entry) {
	size := e.size()
	if size > c.shardBytes || e.owner != 0 && c.shares.cap > 0 && size > c.shares.cap {
		c.tooBig.Add(1)
		return
	}
	c.store(e, size)
	for _, v := range c.shares.charge(e, size) {
		c.remove(v)
	}
}

// remove takes v out of its shard if it is still there (an entry over its owner's
// share: shares.charge already uncounted it).
func (c *cache) remove(v *entry) {
	s := c.shard(v.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m[v.hash] != v {
		return // evicted or replaced meanwhile
	}
	delete(s.m, v.hash)
	size := v.size()
	s.bytes -= size
	c.bytes.Add(-int64(size))
	c.entries.Add(-1)
}

// store puts e into its shard (put).
func (c *cache) store(e *entry, size int) {
	s := c.shard(e.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	m := s.m
	added, freed := 1, 0
	if prev := m[e.hash]; prev != nil {
		added--
		freed += prev.size()
		c.shares.uncharge(prev)
	}
	m[e.hash] = e
	bytes := s.bytes + size - freed
	evicted := 0
	for len(m) > s.cap || bytes > c.shardBytes {
		// Sample up to 8 other entries (map iteration starts at a random point) and
		// evict the one whose stale window ends first: dead entries go before live ones.
		best, victim, n := int64(1<<63-1), uint64(0), 0
		for h, v := range m {
			if h == e.hash {
				continue
			}
			if v.exp+c.stale < best {
				best, victim = v.exp+c.stale, h
			}
			if n++; n == 8 {
				break
			}
		}
		if n == 0 {
			break
		}
		bytes -= m[victim].size()
		c.shares.uncharge(m[victim])
		delete(m, victim)
		evicted++
	}
	c.bytes.Add(int64(bytes - s.bytes))
	s.bytes = bytes
	c.entries.Add(int64(added - evicted))
	c.evicted.Add(uint64(evicted))
}

// len returns the number of stored entries.
func (c *cache) len() int64 { return c.entries.Load() }
