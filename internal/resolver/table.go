package resolver

import (
	"math/rand/v2"
	"net/netip"
	"strings"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// maxFastAddrs is the most addresses the wire table path writes; larger answers take
// the unpacked path.
const maxFastAddrs = 64

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

// tableWire is the table stage of a wire-decoded query. It answers A and AAAA of
// names the table knows exactly or by autopath, and (when authoritative) unknown names
// under the cluster domain, straight into out; it sends external names that a known
// client's search path expanded to the forward stage with a CNAME (autopath for
// external names); other query types, wildcard matches and answers that need
// truncation go to the unpacked path. done is false when the query is to be forwarded
// as asked.
func (w *worker) tableWire(r *request, out []byte) (b []byte, done bool) {
	s := w.s
	if r.qtype != dns.TypeA && r.qtype != dns.TypeAAAA {
		return w.serveUnpacked(r, out), true
	}
	qtype, lname := r.qtype, r.lname
	t := s.tables.Table()
	if t == nil {
		return nil, false // not loaded yet: forward rather than fail
	}
	// lname aliases the worker's buffer: nothing below retains it (the table returns
	// its own strings; wildcard matches, whose target would be a substring, take the
	// unpacked path).
	n, wild := t.Find(lname, r.client.addr)
	if wild || (n != nil && n.Host.CNAME() != "") {
		return w.serveUnpacked(r, out), true // re-owned records or an alias
	}
	var target string
	var soa []byte
	rcode := dns.RcodeSuccess
	if n == nil {
		if s.autopathCandidate(lname) {
			n, target, wild = s.autopathTarget(t, lname, r.client.addr)
			if wild || (n != nil && n.Host.CNAME() != "") {
				return w.serveUnpacked(r, out), true
			}
		}
		if n == nil {
			if s.podRecords && strings.HasSuffix(lname, s.dotPod) {
				return w.serveUnpacked(r, out), true // pod records
			}
			if ext, ok := s.externalAutopath(t, lname, r.client.addr); ok {
				if b, done := w.filterAAAA(r, out, ext); done {
					return b, true
				}
				return w.forwardWire(r, out, ext, ext), true
			}
			// Authoritative NXDOMAIN (or NODATA for an empty non-terminal) under the
			// cluster domain; anything else is forwarded.
			if !s.authoritative || !(strings.HasSuffix(lname, s.dotDomain) || lname == s.domain) {
				return nil, false
			}
			if !t.IsEmptyNonTerminal(lname) {
				rcode = dns.RcodeNameError
			}
			if soa = w.soaWire(t, t.DomainSOA()); soa == nil {
				return w.serveUnpacked(r, out), true
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
				return w.serveUnpacked(r, out), true // CNAME without data
			}
			if soa = w.soaWire(t, t.SOA(h)); soa == nil {
				return w.serveUnpacked(r, out), true
			}
		}
	}
	k := len(addrs)
	if k > maxFastAddrs {
		return w.serveUnpacked(r, out), true
	}
	size := r.qend + k*(12+rdlen) + len(soa)
	if target != "" {
		size += 12 + len(target) + 1
	}
	if r.edns {
		size += 11
	}
	if size > r.limit || size > len(out) {
		return w.serveUnpacked(r, out), true // truncation
	}
	an := uint16(k)
	if target != "" {
		an++
	}
	ns := uint16(0)
	if soa != nil {
		ns = 1
	}
	b = writeHeader(out, r, true, rcode, an, ns, 0)
	ttl := s.ttl
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
	if r.edns {
		b = appendOPT(b, r.do, 0)
	}
	src, kind := srcTable, tap.Table
	if target != "" {
		src, kind = srcAutopath, tap.Autopath
	}
	return r.answered(b, rcode, src, kind), true
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
