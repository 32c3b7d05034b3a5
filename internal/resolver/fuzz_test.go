package resolver

import (
	"encoding/binary"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/talkers"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// cannedForwarder answers every forwarded query at once without the network:
// NXDOMAIN with an SOA, as packed records.
type cannedForwarder struct{ a upstream.Answer }

func newCannedForwarder() *cannedForwarder {
	soa := &dns.SOA{Hdr: dns.RR_Header{Name: ".", Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 60},
		Ns: "a.", Mbox: "b.", Minttl: 60}
	buf := make([]byte, 256)
	n, _ := dns.PackRR(soa, buf, 0, nil, false)
	return &cannedForwarder{a: upstream.Answer{Records: buf[:n], Authority: 1, Rcode: dns.RcodeNameError, RecursionAvailable: true}}
}

func (c *cannedForwarder) Cached(*upstream.Query) (upstream.Answer, bool) { return c.a, true }
func (c *cannedForwarder) ForwardAsync(_ *upstream.Query, done upstream.Waiter) {
	done(c.a, nil)
}

// handlePacket runs one message through the real entry point, Server's worker.serve,
// exactly as the transports call it, and returns the reply bytes (nil = not answered).
// Like the transports, it reuses one client struct per worker and protocol.
func handlePacket(w *worker, pkt, out []byte, proto proto) []byte {
	return w.serve(pkt, out, &testClients[proto], time.Now())
}

var testClients = [nProtos]client{
	{proto: protoUDP, addr: netip.MustParseAddr("127.0.0.2")},
	{proto: protoTCP, addr: netip.MustParseAddr("127.0.0.2")},
}

func FuzzServeDNS(f *testing.F) {
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		f.Fatal(err)
	}
	st := &staticTable{}
	st.t.Store(tb)
	s, err := New(Config{Listen: []string{"127.0.0.1:0"}, Table: st, Forwarder: newCannedForwarder(),
		Authoritative: true, SearchDomains: []string{"corp.internal"}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		f.Fatal(err)
	}
	fp := newWorker(s)
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
		{"www.example.com.ns3.svc.cluster.local.", dns.TypeA},
		{"ext.example.org.", dns.TypeAAAA},
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
			reply := handlePacket(fp, pkt, out, proto)
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
						limit = min(max(limit, int(o.UDPSize())), maxUDPResponse)
					}
				}
			}
			if len(reply) > limit {
				t.Fatalf("%s: %d-byte reply over the %d limit", protoNames[proto], len(reply), limit)
			}
		}
	})
}

func benchServer(t testing.TB, mod func(*Config)) *worker {
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	st := &staticTable{}
	st.t.Store(tb)
	cfg := Config{Listen: []string{"127.0.0.1:0"}, Table: st, Forwarder: newCannedForwarder(),
		Authoritative: true, Logger: slog.New(slog.DiscardHandler)}
	if mod != nil {
		mod(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return newWorker(s)
}

// BenchmarkServe measures the real entry point (what the sockets call) per message,
// without sockets: 0 allocs/op on the in-table and cache paths.
func BenchmarkServe(b *testing.B) {
	w := benchServer(b, nil)
	for _, c := range benchQueries {
		b.Run(c.name, func(b *testing.B) {
			pkt, out := benchPacket(c.qname, c.qtype)
			b.ReportAllocs()
			for b.Loop() {
				if handlePacket(w, pkt, out, c.proto) == nil {
					b.Fatal("no reply")
				}
			}
		})
	}
}

// BenchmarkServeAttributed is BenchmarkServe with who-asked on, as the agent
// runs it: every datagram's sender looked up (a stand-in for the datapath's
// flow records, which are a few loads of mapped memory) and counted per
// workload; "idle tap" has no tap subscriber, "tap" one that takes
// everything (and is drained as it goes). 0 allocs/op on the in-table path.
func BenchmarkServeAttributed(b *testing.B) {
	tr, err := talkers.New(talkers.Config{Name: func(workload.Key) workload.Identity { return workload.Identity{} }})
	if err != nil {
		b.Fatal(err)
	}
	hub := tap.NewHub(1, 0)
	w := benchServer(b, func(c *Config) { c.Senders, c.Talkers, c.Tap = portSenders, tr.Counter(), hub })
	src := netip.MustParseAddrPort("10.0.0.7:40000")
	for _, tapped := range []bool{false, true} {
		mode := "idle tap"
		if tapped {
			mode = "tap"
		}
		for _, c := range benchQueries {
			b.Run(mode+"/"+c.name, func(b *testing.B) {
				var sub *tap.Sub
				if tapped {
					if sub, err = hub.Subscribe(tap.Filter{}); err != nil {
						b.Fatal(err)
					}
					defer sub.Close()
				}
				pkt, out := benchPacket(c.qname, c.qtype)
				cl := &client{proto: c.proto}
				var ev tap.Event
				b.ReportAllocs()
				for b.Loop() {
					cl.setSender(w.s, src)
					if w.serve(pkt, out, cl, time.Now()) == nil {
						b.Fatal("no reply")
					}
					if sub != nil {
						sub.Next(&ev)
					}
				}
			})
		}
	}
}

func benchPacket(qname string, qtype uint16) (pkt, out []byte) {
	m := new(dns.Msg)
	m.SetQuestion(qname, qtype)
	m.SetEdns0(1232, false)
	pkt, _ = m.Pack()
	return pkt, make([]byte, dns.MaxMsgSize)
}

// benchQueries are BenchmarkServe's cases.
var benchQueries = []struct {
	name  string
	qname string
	qtype uint16
	proto proto
}{
	{"table/A", "reviews.ns2.svc.cluster.local.", dns.TypeA, protoUDP},
	{"table/autopath", "reviews.ns2.ns1.svc.cluster.local.", dns.TypeA, protoUDP},
	{"table/A-tcp", "reviews.ns2.svc.cluster.local.", dns.TypeA, protoTCP},
	{"table/NODATA", "productpage.ns1.svc.cluster.local.", dns.TypeAAAA, protoUDP},
	{"table/NXDOMAIN", "nope.ns1.svc.cluster.local.", dns.TypeA, protoUDP},
	{"cache/A", "www.example.com.", dns.TypeA, protoUDP},
	{"cache/autopath", "www.example.com.ns1.svc.cluster.local.", dns.TypeA, protoUDP},
	{"unpacked/SRV", "_http._tcp.reviews.ns2.svc.cluster.local.", dns.TypeSRV, protoUDP},
}
