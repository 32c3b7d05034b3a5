package resolver

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// The wire encoder: responses written straight into the caller's buffer, from a
// table decision (encodeTableWire) or a forwarded answer's packed records
// (encodeWire), without miekg/dns and without allocating.

// maxFastAddrs is the most addresses the wire table path writes; larger answers take
// the unpacked path.
const maxFastAddrs = 64

// encodeTableWire renders a decision answered from the table straight into out, for
// a query decodeWire took: A and AAAA, at most one CNAME (from the question), the
// host's addresses (at most maxFastAddrs) or an SOA in the authority section. It
// returns nil (declines) for anything else and for a response that needs truncation:
// the dns.Msg encoder renders the same decision then.
func (w *worker) encodeTableWire(r *request, d *decision, out []byte) []byte {
	if r.qend == 0 || (r.qtype != dns.TypeA && r.qtype != dns.TypeAAAA) ||
		d.more != nil || d.srv || d.soaAnswer || len(d.chain) > 1 {
		return nil
	}
	var target string
	if len(d.chain) == 1 {
		if d.chain[0].owner != "" {
			return nil
		}
		target = d.chain[0].target
	}
	var addrs []netip.Addr
	rdlen := 4
	if d.addrs && d.host != nil {
		addrs = d.host.V4
		if r.qtype == dns.TypeAAAA {
			addrs, rdlen = d.host.V6, 16
		}
	}
	var soa []byte
	if d.soa != nil {
		if soa = w.soaWire(d.t, d.soa); soa == nil {
			return nil
		}
	}
	k := len(addrs)
	if k > maxFastAddrs {
		return nil
	}
	size := r.qend + k*(12+rdlen) + len(soa)
	if target != "" {
		size += 12 + len(target) + 1
	}
	if r.edns {
		size += 11
	}
	if size > r.limit || size > len(out) {
		return nil // truncation
	}
	an := uint16(k)
	if target != "" {
		an++
	}
	ns := uint16(0)
	if soa != nil {
		ns = 1
	}
	b := writeHeader(out, r, d.aa, d.rcode, an, ns, 0)
	ttl := w.s.ttl
	owner := uint16(0xc000 | 12)
	if target != "" {
		b = appendRRHeader(b, owner, dns.TypeCNAME, ttl, uint16(len(target)+1))
		owner = uint16(0xc000 | len(b))
		b = appendName(b, target)
	}
	for i := range k {
		w.perm[i] = uint8(i)
	}
	for i := k - 1; i > 0; i-- {
		j := rand.IntN(i + 1)
		w.perm[i], w.perm[j] = w.perm[j], w.perm[i]
	}
	for _, p := range w.perm[:k] {
		b = appendRRHeader(b, owner, r.qtype, ttl, uint16(rdlen))
		if rdlen == 4 {
			a := addrs[p].As4()
			b = append(b, a[:]...)
		} else {
			a := addrs[p].As16()
			b = append(b, a[:]...)
		}
	}
	b = append(b, soa...)
	if r.edns {
		b = appendOPT(b, r.do, 0)
	}
	return b
}

// soaCache holds the packed SOA records of negative table answers for one table (one
// cache per worker, so no lock).
type soaCache struct {
	table *nametable.Table
	wire  map[*dns.SOA][]byte
}

// soa returns the wire form of a table SOA with the server's TTL.
func (w *worker) soaWire(t *nametable.Table, soa *dns.SOA) []byte {
	c := &w.soa
	if c.table != t {
		c.table, c.wire = t, map[*dns.SOA][]byte{}
	}
	if b, ok := c.wire[soa]; ok {
		return b
	}
	cp := *soa
	cp.Hdr.Ttl, cp.Minttl = w.s.ttl, w.s.ttl
	buf := make([]byte, 512)
	n, err := dns.PackRR(&cp, buf, 0, nil, false)
	if err != nil {
		return nil
	}
	c.wire[soa] = buf[:n:n]
	return buf[:n:n]
}

// writeHeader starts a wire response: the client's ID, opcode, question and RD/CD bits,
// QR and RA set, the given AA bit and rcode, and the section counts.
func writeHeader(out []byte, r *request, aa bool, rcode int, an, ns, ar uint16) []byte {
	b := out[:r.qend]
	copy(b, r.pkt[:r.qend])
	b[2] = 0x80 | r.pkt[2]&0x01 // QR, RD
	if aa {
		b[2] |= 0x04
	}
	b[3] = 0x80 | r.pkt[3]&0x10 | byte(rcode&0xf) // RA, CD
	if r.edns {
		ar++
	}
	binary.BigEndian.PutUint16(b[6:], an)
	binary.BigEndian.PutUint16(b[8:], ns)
	binary.BigEndian.PutUint16(b[10:], ar)
	return b
}

// appendOPT appends our OPT record (UDP size ourUDPSize, the client's DO, the upper
// bits of an extended rcode).
func appendOPT(b []byte, do bool, rcode int) []byte {
	var flags byte
	if do {
		flags = 0x80
	}
	return append(b, 0, 0, byte(dns.TypeOPT), byte(ourUDPSize>>8), byte(ourUDPSize&0xff), byte(rcode>>4), 0, flags, 0, 0, 0)
}

func appendRRHeader(b []byte, owner, rrtype uint16, ttl uint32, rdlen uint16) []byte {
	return append(b, byte(owner>>8), byte(owner), byte(rrtype>>8), byte(rrtype),
		0, byte(dns.ClassINET), byte(ttl>>24), byte(ttl>>16), byte(ttl>>8), byte(ttl),
		byte(rdlen>>8), byte(rdlen))
}

// appendName writes a lower-case FQDN ("a.b.") as uncompressed wire labels. Names
// here are table names or names that decodeWire accepted: plain labels, no escapes.
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

// headerOnly builds a 12-byte response with the given rcode.
func headerOnly(id uint16, opcode, rcode int, out []byte) []byte {
	b := out[:12]
	clear(b)
	binary.BigEndian.PutUint16(b[0:], id)
	b[2] = 0x80 | byte(opcode&0xf)<<3
	b[3] = 0x80 | byte(rcode&0xf) // RA
	return b
}

// encodeWire writes the response to a wire-decoded query from a forwarded answer: the
// client's header bits and question (echo), an optional CNAME from the question to
// cname, the answer's packed records and our OPT. It returns nil when the response
// does not fit limit (the caller truncates through the unpacked path).
func encodeWire(out, echo []byte, edns, do bool, limit int, ttl uint32, cname string, a *upstream.Answer) []byte {
	size := len(echo) + len(a.Records)
	if cname != "" {
		size += 12 + len(cname) + 1
	}
	if edns {
		size += 11
	}
	if size > limit || size > len(out) {
		return nil
	}
	rc := rcodeOf(a, edns)
	recs, an, ns, ar := a.Records, a.Answer, a.Authority, a.Extra
	if rc != a.Rcode {
		recs, an, ns, ar, cname = nil, 0, 0, 0, "" // an inexpressible rcode: bare SERVFAIL
	}
	if cname != "" {
		an++
	}
	r := request{pkt: echo, qend: len(echo), edns: edns}
	b := writeHeader(out, &r, a.Authoritative && cname == "", rc, an, ns, ar)
	if a.AuthenticData && (do || echo[3]&0x20 != 0) && cname == "" {
		b[3] |= 0x20
	}
	if cname != "" {
		b = appendRRHeader(b, 0xc000|12, dns.TypeCNAME, ttl, uint16(len(cname)+1))
		b = appendName(b, cname)
	}
	recStart := len(b)
	b = append(b, recs...)
	if cname == "" {
		echoOwnerCase(b, echo[12:len(echo)-4], recStart, int(an))
	}
	if edns {
		b = appendOPT(b, do, rc)
	}
	return b
}

// echoOwnerCase gives the client's spelling back: in the n uncompressed records that
// start at b[off:], each owner name that is the question's name qname (wire form) but
// for case is overwritten with qname. Cached and upstream records carry the lower-cased
// name the upstream was asked.
func echoOwnerCase(b, qname []byte, off, n int) {
	for ; n > 0; n-- {
		end := off
		for end < len(b) && b[end] != 0 && b[end] < 64 {
			end += 1 + int(b[end])
		}
		if end >= len(b) || b[end] != 0 {
			return // compressed or malformed: leave the rest as it is
		}
		end++
		if end+10 > len(b) {
			return
		}
		if name := b[off:end]; len(name) == len(qname) && equalFoldWire(name, qname) {
			copy(name, qname)
		}
		off = end + 10 + int(binary.BigEndian.Uint16(b[end+8:]))
	}
}

// equalFoldWire compares two wire names ASCII case-insensitively (length bytes are
// below 64, so folding letters never touches them).
func equalFoldWire(a, b []byte) bool {
	for i := range a {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}
