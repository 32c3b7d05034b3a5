package resolver

import (
	"encoding/binary"
	"net/netip"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// The egress grant step (DNS-gated egress, docs/egress.md). finish calls it for
// every answer to a sender the datapath found in an egress workload, before the
// transport sends the answer: the answer's addresses are granted to that
// workload (when its policy allows the name) before the client can connect to
// them. Table, cache and upstream answers are granted alike, from the encoded
// response.

// Granter is the egress controller's grant step (egressctl.Controller.Grant).
type Granter func(workload uint32, name string, addrs []netip.Addr, ttl time.Duration) (bool, error)

// maxGrantAddrs is the most addresses one answer grants.
const maxGrantAddrs = 64

// answerAddrs reads the A and AAAA records of a response's answer section (a
// CNAME chain's final addresses among them) into buf, and their smallest TTL.
// A response it cannot read yields none.
func answerAddrs(resp []byte, buf []netip.Addr) (addrs []netip.Addr, ttl uint32) {
	if len(resp) < 12 || resp[3]&0x0f != dns.RcodeSuccess {
		return nil, 0
	}
	qd, an := int(binary.BigEndian.Uint16(resp[4:])), int(binary.BigEndian.Uint16(resp[6:]))
	off := 12
	for range qd {
		if off = skipName(resp, off); off < 0 || off+4 > len(resp) {
			return nil, 0
		}
		off += 4
	}
	addrs = buf[:0]
	ttl = ^uint32(0)
	for range an {
		if off = skipName(resp, off); off < 0 || off+10 > len(resp) {
			return addrs, ttl
		}
		typ := binary.BigEndian.Uint16(resp[off:])
		rrTTL := binary.BigEndian.Uint32(resp[off+4:])
		rdlen := int(binary.BigEndian.Uint16(resp[off+8:]))
		off += 10
		if off+rdlen > len(resp) {
			return addrs, ttl
		}
		var a netip.Addr
		switch {
		case typ == dns.TypeA && rdlen == 4:
			a = netip.AddrFrom4([4]byte(resp[off : off+4]))
		case typ == dns.TypeAAAA && rdlen == 16:
			a = netip.AddrFrom16([16]byte(resp[off : off+16]))
		}
		if a.IsValid() && len(addrs) < maxGrantAddrs {
			addrs = append(addrs, a)
			ttl = min(ttl, rrTTL)
		}
		off += rdlen
	}
	if len(addrs) == 0 {
		ttl = 0
	}
	return addrs, ttl
}

// skipName returns the offset after the (possibly compressed) name at off, or
// -1 when it runs past the message.
func skipName(b []byte, off int) int {
	for off < len(b) {
		l := int(b[off])
		switch {
		case l == 0:
			return off + 1
		case l&0xc0 == 0xc0:
			if off+2 > len(b) {
				return -1
			}
			return off + 2
		case l&0xc0 != 0:
			return -1
		}
		off += 1 + l
	}
	return -1
}

// grantAnswer offers an answer's addresses to the sender's egress workload:
// granted for the answer's TTL when its policy allows the name. The name is the
// question's, or, for an autopath answer (our own CNAME from the search-path
// expansion to the real name), the CNAME's target. A grant that cannot be
// written is logged; the answer is sent all the same (the connect is then
// denied, and counted).
func (s *Server) grantAnswer(o *outcome) {
	if o.rcode != dns.RcodeSuccess || len(o.resp) < 12 {
		return
	}
	var buf [maxGrantAddrs]netip.Addr
	addrs, ttl := answerAddrs(o.resp, buf[:])
	if len(addrs) == 0 {
		return
	}
	name := o.name
	if o.kind == tap.Autopath {
		if target, ok := autopathTarget(o.resp); ok {
			name = target
		}
	}
	if _, err := s.grant(o.c.egress, name, addrs, time.Duration(ttl)*time.Second); err != nil {
		s.log.Debug("egress grant", "workload", o.c.egress, "name", name, "err", err)
	}
}

// autopathTarget is the target of the answer's first record when it is a
// CNAME (an autopath answer's: the real name the expansion stands for).
func autopathTarget(resp []byte) (string, bool) {
	qd := int(binary.BigEndian.Uint16(resp[4:]))
	off := 12
	for range qd {
		if off = skipName(resp, off); off < 0 || off+4 > len(resp) {
			return "", false
		}
		off += 4
	}
	if off = skipName(resp, off); off < 0 || off+10 > len(resp) || binary.BigEndian.Uint16(resp[off:]) != dns.TypeCNAME {
		return "", false
	}
	name, _, err := dns.UnpackDomainName(resp, off+10)
	return name, err == nil
}
