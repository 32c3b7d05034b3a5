package upstream

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// Cache key flags: the DO and CD bits of the query take part in the key, because a
// DNSSEC-aware (DO) or checking-disabled (CD) client must not get an answer fetched
// without them, nor the other way round.
const (
	flagDO uint8 = 1 << iota
	flagCD
)

// cacheKey identifies a cache entry: lower-cased name, type, class and flags.
type cacheKey struct {
	name   string // lower-cased
	qtype  uint16
	qclass uint16
	flags  uint8
}

// entry kinds.
const (
	kindSuccess  uint8 = iota // NOERROR with answers
	kindDenial                // NXDOMAIN or NODATA with an SOA (RFC 2308)
	kindUncached              // passed to the waiting clients, never stored
)

// entry is one answer: the upstream response without its OPT record, and its cache
// lifetime. Everything but the atomics is immutable after creation, so readers need no
// lock.
type entry struct {
	key   cacheKey
	hash  uint64
	kind  uint8
	hdr   dns.MsgHdr // Rcode, Authoritative, RecursionAvailable, AuthenticatedData
	ttl   uint32     // cache lifetime in seconds after floors and caps
	exp   int64      // expiry, clock nanoseconds
	rrs   []dns.RR   // answer, authority and additional records, in that order
	na    int        // len of the answer section in rrs
	nns   int        // len of the authority section in rrs
	hits  atomic.Uint32
	fetch atomic.Bool // a prefetch or stale refresh is under way
	snap  atomic.Pointer[snapshot]
}

// snapshot is the entry's records with every TTL set to one value, and the same records
// packed. Clients of the same second share a snapshot; it is rebuilt at most once per
// second per entry.
type snapshot struct {
	ttl  uint32
	rrs  []dns.RR
	wire []byte // rrs packed without compression (position independent); nil if they do not pack
}

// records returns the entry's records with TTL ttl (or as received for an uncached
// entry). The records are shared and must not be modified.
func (e *entry) records(ttl uint32) []dns.RR {
	if e.kind == kindUncached {
		return e.rrs
	}
	return e.snapshot(ttl).rrs
}

// snapshot returns the entry's snapshot for ttl, building it if the current one is for
// another second.
func (e *entry) snapshot(ttl uint32) *snapshot {
	if s := e.snap.Load(); s != nil && s.ttl == ttl {
		return s
	}
	s := &snapshot{ttl: ttl, rrs: make([]dns.RR, len(e.rrs))}
	size := 0
	for i, rr := range e.rrs {
		c := dns.Copy(rr)
		c.Header().Ttl = ttl
		s.rrs[i] = c
		size += dns.Len(c)
	}
	s.wire = packRecords(s.rrs, size)
	e.snap.Store(s)
	return s
}

// packRecords packs rrs one after the other without name compression, so the bytes
// can be placed after any question; nil if a record does not pack.
func packRecords(rrs []dns.RR, size int) []byte {
	buf := make([]byte, size)
	off := 0
	for _, rr := range rrs {
		n, err := dns.PackRR(rr, buf, off, nil, false)
		if err != nil {
			return nil
		}
		off = n
	}
	return buf[:off:off]
}

// remaining returns the whole seconds (rounded up) until e expires at now, 0 if expired.
func (e *entry) remaining(now int64) uint32 {
	d := e.exp - now
	if d <= 0 {
		return 0
	}
	return uint32((d + int64(time.Second) - 1) / int64(time.Second))
}

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

// shard is one part of the cache. Its map is copy-on-write: a hit is one atomic load
// and a map lookup with no lock and no write to shared memory, so concurrent hits on a
// hot entry do not contend; an insert (a miss, which costs an upstream round trip
// anyway) copies the shard's few dozen entries under the writer lock.
type shard struct {
	m   atomic.Pointer[map[uint64]*entry]
	mu  sync.Mutex // serialises writers
	cap int
	_   [64]byte // against false sharing between shards
}

// cache is a bounded, sharded map of entries. Eviction picks, among a few random
// samples of a full shard, the entry whose stale window ends first.
type cache struct {
	shards  []shard
	mask    uint64
	entries atomic.Int64
	evicted atomic.Uint64
	stale   int64 // stale window in nanoseconds, for eviction preference
}

const (
	minShards       = 256
	maxShards       = 1 << 16
	entriesPerShard = 32 // target shard size, which bounds the copy per insert
)

func newCache(size int, stale time.Duration) *cache {
	n := minShards
	if size < n*4 {
		// Small caches: fewer shards so that each holds a few entries.
		n = 1 << (bits.Len(uint(max(size/4, 1))) - 1)
	}
	for n < maxShards && size/n > entriesPerShard {
		n *= 2
	}
	c := &cache{shards: make([]shard, n), mask: uint64(n - 1), stale: int64(max(stale, 0))}
	for i := range c.shards {
		per := size / n // the capacities add up to size exactly
		if i < size%n {
			per++
		}
		m := make(map[uint64]*entry)
		c.shards[i].m.Store(&m)
		c.shards[i].cap = max(per, 1)
	}
	return c
}

func (c *cache) shard(h uint64) *shard { return &c.shards[(h>>32^h)&c.mask] }

// get returns the entry for the query key, or nil.
func (c *cache) get(h uint64, name string, qtype, qclass uint16, flags uint8) *entry {
	e := (*c.shard(h).m.Load())[h]
	if e == nil || !e.key.matches(name, qtype, qclass, flags) {
		return nil
	}
	return e
}

// put stores e, replacing an older entry of the same key (or a hash collision) and
// evicting one entry when the shard is full.
func (c *cache) put(e *entry) {
	s := c.shard(e.hash)
	s.mu.Lock()
	defer s.mu.Unlock()
	old := *s.m.Load()
	_, replace := old[e.hash]
	var victim uint64
	evict := !replace && len(old) >= s.cap
	if evict {
		// Sample up to 8 entries (map iteration starts at a random point) and evict the
		// one whose stale window ends first: dead entries go before live ones.
		best := int64(1<<63 - 1)
		n := 0
		for h, v := range old {
			if v.exp+c.stale < best {
				best, victim = v.exp+c.stale, h
			}
			if n++; n == 8 {
				break
			}
		}
	}
	m := make(map[uint64]*entry, len(old)+1)
	for h, v := range old {
		if !evict || h != victim {
			m[h] = v
		}
	}
	m[e.hash] = e
	s.m.Store(&m)
	switch {
	case evict:
		c.evicted.Add(1)
	case !replace:
		c.entries.Add(1)
	}
}

// len returns the number of stored entries.
func (c *cache) len() int64 { return c.entries.Load() }
