package upstream

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// Source says where an answer came from.
type Source uint8

// Sources of an Answer.
const (
	SourceCache    Source = iota // a fresh cache entry
	SourceUpstream               // an upstream answered this query (or an identical concurrent one)
	SourceStale                  // an expired entry, served because the upstreams failed (RFC 8767)
)

func (s Source) String() string {
	switch s {
	case SourceCache:
		return "cache"
	case SourceUpstream:
		return "upstream"
	case SourceStale:
		return "stale"
	}
	return "unknown"
}

// Query is one question to forward. Name is the lower-cased FQDN; the caller echoes the
// client's own spelling of the question.
type Query struct {
	Name          string
	Qtype, Qclass uint16
	DO, CD        bool   // the client's DNSSEC OK and Checking Disabled bits (part of the cache key)
	ClientID      uint16 // the client's message ID, never reused for the upstream query
	// Owner is the workload the miss is charged to (the resolver's workload id, never
	// 0): the answer it brings into the cache counts against that workload's share
	// (Config.CacheWorkloadBytes). 0 charges nobody.
	Owner uint64
}

func (q *Query) flags() uint8 {
	var f uint8
	if q.DO {
		f |= flagDO
	}
	if q.CD {
		f |= flagCD
	}
	return f
}

// Answer is an upstream or cached answer in wire form: the caller writes the header and
// question of its own response and appends Records. It is built once per entry and TTL
// second and shared by every client of that second: nothing in it may be modified.
type Answer struct {
	// Records holds the answer, authority and additional records (never an OPT), packed
	// one after the other without name compression, so the bytes fit after any question.
	// Every TTL is already set to what the client is to see.
	Records                  []byte
	Answer, Authority, Extra uint16 // record counts of the three sections
	// Rcode may be an extended rcode (> 15), which needs an OPT record to be expressed.
	Rcode                                            int
	Authoritative, AuthenticData, RecursionAvailable bool
	Source                                           Source
	// Server is the upstream that gave the answer (for a cached one: when it
	// was fetched).
	Server netip.AddrPort
}

// RRs unpacks Records into the three sections (new records each call: the caller may
// modify them). For callers that need a dns.Msg, e.g. to truncate.
func (a *Answer) RRs() (answer, ns, extra []dns.RR, err error) {
	off := 0
	n := int(a.Answer) + int(a.Authority) + int(a.Extra)
	all := make([]dns.RR, 0, n)
	for range n {
		var rr dns.RR
		rr, off, err = dns.UnpackRR(a.Records, off)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("unpack cached record: %w", err)
		}
		all = append(all, rr)
	}
	na, nns := int(a.Answer), int(a.Answer)+int(a.Authority)
	return all[:na:na], all[na:nns:nns], all[nns:], nil
}

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

// entry is one upstream answer without its OPT record, kept packed: the records as
// received (uncompressed, original TTLs) and where each TTL is, so a per-second
// snapshot is a copy with the TTLs patched. Everything but the atomics is immutable
// after creation, so readers need no lock.
type entry struct {
	key    cacheKey
	hash   uint64
	kind   uint8
	rcode  int
	aa, ra bool
	ad     bool
	server netip.AddrPort // the upstream that answered
	ttl    uint32         // cache lifetime in seconds after floors and caps
	exp    int64          // expiry, clock nanoseconds
	wire   []byte         // records packed without compression, TTLs as received
	ttlOff []uint32       // offset of each record's TTL field in wire
	na     uint16         // answer records
	nns    uint16         // authority records
	nex    uint16         // additional records
	hits   atomic.Uint32
	fetch  atomic.Bool // a prefetch or stale refresh is under way
	snap   atomic.Pointer[snapshot]

	owner uint64 // the workload charged for the entry (Query.Owner; 0: nobody)
	share shareLink
}

// snapshot is the entry's records with every TTL set to one value. Clients of the same
// second share a snapshot; it is rebuilt at most once per second per entry.
type snapshot struct {
	ttl  uint32
	wire []byte
}

// entryOverhead approximates what an entry costs besides its wire bytes: the struct,
// its key string and map slot, and the snapshot header.
const entryOverhead = 256

// size is the entry's approximate memory footprint in bytes: the records as received,
// one snapshot of the same length, the TTL offsets and the fixed overhead.
func (e *entry) size() int {
	return 2*len(e.wire) + 4*len(e.ttlOff) + len(e.key.name) + entryOverhead
}

// answer returns the entry as an Answer with every TTL set to ttl; an uncached entry
// keeps the TTLs as received.
func (e *entry) answer(ttl uint32, src Source) Answer {
	a := Answer{
		Answer: e.na, Authority: e.nns, Extra: e.nex,
		Rcode: e.rcode, Authoritative: e.aa, AuthenticData: e.ad, RecursionAvailable: e.ra,
		Source: src, Server: e.server,
	}
	if e.kind == kindUncached {
		a.Records = e.wire
	} else {
		a.Records = e.snapshot(ttl).wire
	}
	return a
}

// snapshot returns the entry's records with TTL ttl, building them if the current
// snapshot is for another second.
func (e *entry) snapshot(ttl uint32) *snapshot {
	if s := e.snap.Load(); s != nil && s.ttl == ttl {
		return s
	}
	s := &snapshot{ttl: ttl, wire: make([]byte, len(e.wire))}
	copy(s.wire, e.wire)
	for _, off := range e.ttlOff {
		binary.BigEndian.PutUint32(s.wire[off:], ttl)
	}
	e.snap.Store(s)
	return s
}

// remaining returns the whole seconds (rounded up) until e expires at now, 0 if expired.
func (e *entry) remaining(now int64) uint32 {
	d := e.exp - now
	if d <= 0 {
		return 0
	}
	return uint32((d + int64(time.Second) - 1) / int64(time.Second))
}

// packRecords packs rrs one after the other without name compression and returns the
// bytes and the offset of each record's TTL field.
func packRecords(rrs []dns.RR) ([]byte, []uint32, error) {
	size := 0
	for _, rr := range rrs {
		size += dns.Len(rr) + 64 // Len assumes compression may apply; leave room
	}
	buf := make([]byte, size)
	offs := make([]uint32, 0, len(rrs))
	off := 0
	for _, rr := range rrs {
		start := off
		n, err := dns.PackRR(rr, buf, off, nil, false)
		if err != nil {
			return nil, nil, fmt.Errorf("pack %s record: %w", dns.TypeToString[rr.Header().Rrtype], err)
		}
		// TTL follows the owner name, type and class.
		_, nameEnd, err := dns.UnpackDomainName(buf[:n], start)
		if err != nil {
			return nil, nil, fmt.Errorf("re-read owner name: %w", err)
		}
		offs = append(offs, uint32(nameEnd+4))
		off = n
	}
	return buf[:off:off], offs, nil
}
