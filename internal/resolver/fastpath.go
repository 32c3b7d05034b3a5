package resolver

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"strings"
	"unsafe"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// wireCache is a Forwarder whose cache hits can be served as bytes
// (*upstream.Forwarder). With it the fast path also answers forwarded
// names that are in the cache.
type wireCache interface {
	Cached(lname string, qtype, qclass uint16, do, cd bool, room int) (upstream.CachedAnswer, bool)
}

// maxFastAddrs is the most addresses the wire fast path writes; larger
// answers take the general path.
const maxFastAddrs = 64

// fastPath answers the common UDP query (one A or AAAA question, class IN,
// optional plain OPT; name in the table exactly or by autopath, or, when
// authoritative, unknown under the cluster domain, or a forwarded name with
// a fresh cache entry; answer fits) straight from and into wire bytes: no
// unpacking, no allocation, no lock, no goroutine. Everything else returns
// ok == false and takes the general path, which produces the same answer
// (a test compares the two).
type fastPath struct {
	s     *Server
	cache wireCache // nil: forwarded names always take the general path
	lname [256]byte
	perm  [maxFastAddrs]uint8
	// Packed SOA records for negative answers, per table (one cache per
	// serving goroutine, so no lock).
	soaTable *nametable.Table
	soaWire  map[*dns.SOA][]byte
}

func newFastPath(s *Server) *fastPath {
	f := &fastPath{s: s}
	f.cache, _ = s.fwd.(wireCache)
	return f
}

// soa returns the wire form of a table SOA with the server's TTL.
func (f *fastPath) soa(t *nametable.Table, soa *dns.SOA) []byte {
	if f.soaTable != t {
		f.soaTable, f.soaWire = t, map[*dns.SOA][]byte{}
	}
	if b, ok := f.soaWire[soa]; ok {
		return b
	}
	c := *soa
	c.Hdr.Ttl, c.Minttl = f.s.ttl, f.s.ttl
	buf := make([]byte, 512)
	n, err := dns.PackRR(&c, buf, 0, nil, false)
	if err != nil {
		return nil
	}
	f.soaWire[soa] = buf[:n:n]
	return buf[:n:n]
}

// answer returns the response to pkt written into out and its source
// (srcTable or srcCache), or ok == false for the general path.
func (f *fastPath) answer(pkt, out []byte, client netip.Addr) (resp []byte, src source, ok bool) {
	if len(pkt) < 12+5 || pkt[2]&0xfa != 0 || // QR, opcode, TC
		binary.BigEndian.Uint32(pkt[4:]) != 0x00010000 || // QD=1, AN=0
		pkt[8] != 0 || pkt[9] != 0 || pkt[10] != 0 || pkt[11] > 1 {
		return nil, 0, false
	}
	// Question name: plain labels only, lower-cased into f.lname.
	off, ln := 12, 0
	for {
		if off >= len(pkt) {
			return nil, 0, false
		}
		l := int(pkt[off])
		off++
		if l == 0 {
			break
		}
		if l > 63 || off+l > len(pkt) || ln+l+1 > 254 {
			return nil, 0, false
		}
		for _, c := range pkt[off : off+l] {
			switch {
			case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '_':
			case c >= 'A' && c <= 'Z':
				c += 'a' - 'A'
			default:
				return nil, 0, false // needs escaping: general path
			}
			f.lname[ln] = c
			ln++
		}
		f.lname[ln] = '.'
		ln++
		off += l
	}
	if ln == 0 || off+4 > len(pkt) {
		return nil, 0, false
	}
	qtype := binary.BigEndian.Uint16(pkt[off:])
	if (qtype != dns.TypeA && qtype != dns.TypeAAAA) || binary.BigEndian.Uint16(pkt[off+2:]) != dns.ClassINET {
		return nil, 0, false
	}
	qend := off + 4
	limit, edns, do := dns.MinMsgSize, false, false
	if pkt[11] == 1 {
		o := qend
		if o+11 > len(pkt) || pkt[o] != 0 || binary.BigEndian.Uint16(pkt[o+1:]) != dns.TypeOPT ||
			pkt[o+5] != 0 || pkt[o+6] != 0 || // extended rcode, version
			o+11+int(binary.BigEndian.Uint16(pkt[o+9:])) != len(pkt) {
			return nil, 0, false
		}
		edns, do = true, pkt[o+7]&0x80 != 0
		limit = max(limit, int(binary.BigEndian.Uint16(pkt[o+3:])))
	} else if qend != len(pkt) {
		return nil, 0, false
	}

	t := f.s.tables.Table()
	if t == nil {
		return nil, 0, false
	}
	// The name aliases f.lname: valid only during this call, and nothing
	// below retains it (the table returns its own strings; wildcard
	// matches, whose target would be a substring, go the general path).
	lname := unsafe.String(&f.lname[0], ln)
	n, wild := t.Find(lname, client)
	if wild || (n != nil && n.Host.CNAME != "") {
		return nil, 0, false
	}
	var target string
	var soa []byte
	rcode := byte(dns.RcodeSuccess)
	if n == nil {
		if f.s.autopathCandidate(lname) {
			n, target, wild = f.s.autopathTarget(t, lname, client)
			if wild || (n != nil && n.Host.CNAME != "") {
				return nil, 0, false
			}
		}
		if n == nil {
			if f.s.podRecords && strings.HasSuffix(lname, f.s.dotPod) {
				return nil, 0, false // pod records: general path
			}
			// Authoritative NXDOMAIN (or NODATA for an empty non-terminal)
			// under the cluster domain; anything else is forwarded.
			if !f.s.authoritative || !(strings.HasSuffix(lname, f.s.dotDomain) || lname == f.s.domain) {
				return f.cached(pkt, out, lname, qtype, qend, edns, do, limit)
			}
			if !t.IsEmptyNonTerminal(lname) {
				rcode = dns.RcodeNameError
			}
			if soa = f.soa(t, t.DomainSOA()); soa == nil {
				return nil, 0, false
			}
		}
	}
	var addrs []netip.Addr
	rdlen := 4
	if n != nil {
		h := n.Host
		addrs = h.V4
		if qtype == dns.TypeAAAA {
			addrs, rdlen = h.V6, 16
		}
		if len(addrs) == 0 {
			if target != "" {
				return nil, 0, false // CNAME without data: general path
			}
			if soa = f.soa(t, t.SOA(h)); soa == nil {
				return nil, 0, false
			}
		}
	}
	k := len(addrs)
	if k > maxFastAddrs {
		return nil, 0, false
	}
	size := qend + k*(12+rdlen) + len(soa)
	if target != "" {
		size += 12 + len(target) + 1
	}
	if edns {
		size += 11
	}
	if size > limit || size > len(out) {
		return nil, 0, false
	}

	b := out[:qend]
	copy(b, pkt[:qend])
	b[2] = 0x80 | 0x04 | pkt[2]&0x01  // QR, AA, RD
	b[3] = 0x80 | pkt[3]&0x10 | rcode // RA, CD
	an := k
	if target != "" {
		an++
	}
	binary.BigEndian.PutUint16(b[6:], uint16(an))
	if soa != nil {
		binary.BigEndian.PutUint16(b[8:], 1)
	} else {
		binary.BigEndian.PutUint16(b[8:], 0)
	}
	if edns {
		binary.BigEndian.PutUint16(b[10:], 1)
	} else {
		binary.BigEndian.PutUint16(b[10:], 0)
	}
	ttl := f.s.ttl
	owner := uint16(0xc000 | 12)
	if target != "" {
		b = appendRRHeader(b, owner, dns.TypeCNAME, ttl, uint16(len(target)+1))
		owner = uint16(0xc000 | len(b))
		b = appendName(b, target)
	}
	for i := range k {
		f.perm[i] = uint8(i)
	}
	for i := k - 1; i > 0; i-- {
		j := rand.IntN(i + 1)
		f.perm[i], f.perm[j] = f.perm[j], f.perm[i]
	}
	for _, p := range f.perm[:k] {
		b = appendRRHeader(b, owner, qtype, ttl, uint16(rdlen))
		if rdlen == 4 {
			a := addrs[p].As4()
			b = append(b, a[:]...)
		} else {
			a := addrs[p].As16()
			b = append(b, a[:]...)
		}
	}
	b = append(b, soa...)
	if edns {
		b = appendOPT(b, do)
	}
	f.s.m.requests[protoUDP][qtypeIndex(qtype)].Inc()
	f.s.m.responses[rcode][srcTable].Inc()
	return b, srcTable, true
}

// cached answers a forwarded name from a fresh upstream cache entry: the
// client's header bits and question, the cached sections, our OPT. It
// matches what Server.forward and finish produce for the same hit.
func (f *fastPath) cached(pkt, out []byte, lname string, qtype uint16, qend int, edns, do bool, limit int) ([]byte, source, bool) {
	if f.cache == nil {
		return nil, 0, false
	}
	room := min(limit, len(out)) - qend
	if edns {
		room -= 11
	}
	cd := pkt[3]&0x10 != 0
	a, ok := f.cache.Cached(lname, qtype, dns.ClassINET, do, cd, room)
	if !ok {
		return nil, 0, false
	}
	b := out[:qend]
	copy(b, pkt[:qend])
	b[2] = 0x80 | pkt[2]&0x01 // QR, RD
	if a.Authoritative {
		b[2] |= 0x04
	}
	b[3] = 0x80 | pkt[3]&0x10 | a.Rcode // RA, CD
	if a.AuthenticData && (do || pkt[3]&0x20 != 0) {
		b[3] |= 0x20
	}
	extra := a.Extra
	if edns {
		extra++
	}
	binary.BigEndian.PutUint16(b[6:], a.Answer)
	binary.BigEndian.PutUint16(b[8:], a.Authority)
	binary.BigEndian.PutUint16(b[10:], extra)
	b = append(b, a.Records...)
	if edns {
		b = appendOPT(b, do)
	}
	f.s.m.requests[protoUDP][qtypeIndex(qtype)].Inc()
	f.s.m.responses[rcodeIndex(int(a.Rcode))][srcCache].Inc()
	return b, srcCache, true
}

// appendOPT appends our OPT record (UDP size ourUDPSize, the client's DO).
func appendOPT(b []byte, do bool) []byte {
	var flags byte
	if do {
		flags = 0x80
	}
	return append(b, 0, 0, byte(dns.TypeOPT), byte(ourUDPSize>>8), byte(ourUDPSize&0xff), 0, 0, flags, 0, 0, 0)
}

// autopathCandidate is a cheap pre-check (no allocation) that the name
// ends in the cluster domain or a search domain.
func (s *Server) autopathCandidate(lname string) bool {
	if strings.HasSuffix(lname, s.dotDomain) {
		return true
	}
	for _, sd := range s.dotSearch {
		if strings.HasSuffix(lname, sd) {
			return true
		}
	}
	return false
}

func appendRRHeader(b []byte, owner, rrtype uint16, ttl uint32, rdlen uint16) []byte {
	return append(b, byte(owner>>8), byte(owner), byte(rrtype>>8), byte(rrtype),
		0, byte(dns.ClassINET), byte(ttl>>24), byte(ttl>>16), byte(ttl>>8), byte(ttl),
		byte(rdlen>>8), byte(rdlen))
}

// appendName writes a lower-case FQDN ("a.b.") as uncompressed wire labels.
// Table names are validated plain labels, so no escapes occur.
func appendName(b []byte, name string) []byte {
	start := 0
	for i := 0; i < len(name); i++ {
		if name[i] == '.' {
			b = append(b, byte(i-start))
			b = append(b, name[start:i]...)
			start = i + 1
		}
	}
	return append(b, 0)
}
