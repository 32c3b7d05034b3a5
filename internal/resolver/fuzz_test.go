package resolver

import (
	"context"
	"encoding/binary"
	"log/slog"
	"net/netip"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/nametable"
)

// cannedForwarder answers every forwarded query without the network.
type cannedForwarder struct{}

func (cannedForwarder) Forward(_ context.Context, req *dns.Msg) (*dns.Msg, string, error) {
	m := new(dns.Msg)
	m.SetRcode(req, dns.RcodeNameError)
	m.Ns = []dns.RR{&dns.SOA{Hdr: dns.RR_Header{Name: ".", Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 60},
		Ns: "a.", Mbox: "b.", Minttl: 60}}
	if o := req.IsEdns0(); o != nil {
		m.SetEdns0(4096, o.Do())
	}
	return m, "cache", nil
}

// handlePacket runs one UDP packet through exactly what serveUDP does and
// returns the reply bytes (nil = not answered).
func handlePacket(s *Server, fp *fastPath, pkt, out []byte, proto proto) []byte {
	client := netip.MustParseAddr("127.0.0.2")
	if len(pkt) < 12 {
		return nil
	}
	if proto == protoUDP {
		if b, _, ok := fp.answer(pkt, out, client); ok {
			return b
		}
	}
	req := new(dns.Msg)
	if err := req.Unpack(pkt); err != nil {
		return formErr(pkt, out)
	}
	ri := reqInfo{proto: proto, client: client}
	resp, _ := s.respond(context.Background(), req, &ri)
	if resp == nil {
		return nil
	}
	b, err := resp.PackBuffer(out)
	if err != nil {
		return headerOnly(resp.Id, resp.Opcode, dns.RcodeServerFailure, out)
	}
	return b
}

func FuzzServeDNS(f *testing.F) {
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		f.Fatal(err)
	}
	st := &staticTable{}
	st.t.Store(tb)
	s, err := New(Config{Listen: []string{"127.0.0.1:0"}, Table: st, Forwarder: cannedForwarder{},
		Authoritative: true, SearchDomains: []string{"corp.internal"}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		f.Fatal(err)
	}
	fp := newFastPath(s)
	out := make([]byte, dns.MaxMsgSize)
	// More seeds live in testdata/fuzz/FuzzServeDNS.
	for _, q := range []struct {
		name  string
		qtype uint16
	}{
		{"productpage.ns1.svc.cluster.local.", dns.TypeA},
		{"reviews.ns2.ns1.svc.cluster.local.", dns.TypeAAAA},
		{"_http._tcp.reviews.ns2.", dns.TypeSRV},
		{"headless.ns2.svc.cluster.local.", dns.TypeA},
	} {
		m := new(dns.Msg)
		m.SetQuestion(q.name, q.qtype)
		b, _ := m.Pack()
		f.Add(b)
		m.SetEdns0(1232, true)
		b, _ = m.Pack()
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, pkt []byte) {
		for _, proto := range []proto{protoUDP, protoTCP} {
			reply := handlePacket(s, fp, pkt, out, proto)
			if reply == nil {
				if len(pkt) >= 12 && !(pkt[2]&0x80 != 0 && pkt[3]&0xf == dns.RcodeFormatError) {
					// Only FORMERR responses may go unanswered, and only when
					// they do not parse or carry a FORMERR rcode.
					req := new(dns.Msg)
					if req.Unpack(pkt) != nil || !req.Response || req.Rcode != dns.RcodeFormatError {
						t.Fatalf("%s: no reply to %x", protoNames[proto], pkt)
					}
				}
				continue
			}
			if len(reply) < 12 || binary.BigEndian.Uint16(reply) != binary.BigEndian.Uint16(pkt) || reply[2]&0x80 == 0 {
				t.Fatalf("%s: reply %x to %x: bad header", protoNames[proto], reply, pkt)
			}
			m := new(dns.Msg)
			if err := m.Unpack(reply); err != nil {
				t.Fatalf("%s: reply %x to %x does not unpack: %v", protoNames[proto], reply, pkt, err)
			}
			limit := dns.MaxMsgSize
			if proto == protoUDP {
				limit = dns.MinMsgSize
				req := new(dns.Msg)
				if req.Unpack(pkt) == nil {
					if o := req.IsEdns0(); o != nil {
						limit = max(limit, int(o.UDPSize()))
					}
				}
			}
			if len(reply) > limit {
				t.Fatalf("%s: %d-byte reply over the %d limit", protoNames[proto], len(reply), limit)
			}
		}
	})
}

func benchServer(b *testing.B) (*Server, *fastPath) {
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		b.Fatal(err)
	}
	st := &staticTable{}
	st.t.Store(tb)
	s, err := New(Config{Listen: []string{"127.0.0.1:0"}, Table: st, Forwarder: cannedForwarder{},
		Authoritative: true, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	return s, newFastPath(s)
}

// BenchmarkHandle measures the per-packet work without sockets.
func BenchmarkHandle(b *testing.B) {
	s, fp := benchServer(b)
	for _, c := range []struct {
		name  string
		qname string
		qtype uint16
		proto proto
	}{
		{"fast/A", "reviews.ns2.svc.cluster.local.", dns.TypeA, protoUDP},
		{"fast/autopath", "reviews.ns2.ns1.svc.cluster.local.", dns.TypeA, protoUDP},
		{"general/A-tcp", "reviews.ns2.svc.cluster.local.", dns.TypeA, protoTCP},
		{"general/NODATA", "productpage.ns1.svc.cluster.local.", dns.TypeAAAA, protoUDP},
		{"general/NXDOMAIN", "nope.ns1.svc.cluster.local.", dns.TypeA, protoUDP},
	} {
		b.Run(c.name, func(b *testing.B) {
			m := new(dns.Msg)
			m.SetQuestion(c.qname, c.qtype)
			m.SetEdns0(1232, false)
			pkt, _ := m.Pack()
			out := make([]byte, dns.MaxMsgSize)
			b.ReportAllocs()
			for b.Loop() {
				if handlePacket(s, fp, pkt, out, c.proto) == nil {
					b.Fatal("no reply")
				}
			}
		})
	}
}
