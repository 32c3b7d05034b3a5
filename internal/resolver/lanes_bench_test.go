package resolver

import (
	"strings"
	"testing"

	"github.com/miekg/dns"
)

// BenchmarkServeNdots is the ndots lane of bench/ as a Go benchmark: the 16 queries
// glibc sends with ndots:5 from a pod in ns3 for a mesh name written without the
// trailing dot (reviews.ns2) and an external name (www.example.com), A and AAAA for
// each search suffix and then the name itself. ns/op and allocs/op are per message.
func BenchmarkServeNdots(b *testing.B) {
	w := benchServer(b, nil)
	var pkts [][]byte
	for _, name := range []string{"reviews.ns2.", "www.example.com."} {
		for _, suffix := range []string{"ns3.svc.cluster.local.", "svc.cluster.local.", "cluster.local.", ""} {
			for _, qtype := range []uint16{dns.TypeA, dns.TypeAAAA} {
				pkt, _ := benchPacket(name+suffix, qtype)
				pkts = append(pkts, pkt)
			}
		}
	}
	out := make([]byte, dns.MaxMsgSize)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if handlePacket(w, pkts[i%len(pkts)], out, protoUDP) == nil {
			b.Fatal("no reply")
		}
		i++
	}
}

// TestServeNoAllocs keeps the in-table, cache and ndots queries of the benchmarks free
// of allocation: the decision and the outcome live on serve's stack and in the
// worker, never on the heap (a decision that escaped would cost one allocation per
// query).
func TestServeNoAllocs(t *testing.T) {
	w := benchServer(t, nil)
	out := make([]byte, dns.MaxMsgSize)
	var cases []benchCase
	for _, c := range benchQueries {
		if !strings.HasPrefix(c.name, "unpacked/") {
			pkt, _ := benchPacket(c.qname, c.qtype)
			cases = append(cases, benchCase{c.name, pkt, c.proto})
		}
	}
	for _, name := range []string{"reviews.ns2.", "www.example.com."} {
		for _, suffix := range []string{"ns3.svc.cluster.local.", ""} {
			for _, qtype := range []uint16{dns.TypeA, dns.TypeAAAA} {
				pkt, _ := benchPacket(name+suffix, qtype)
				cases = append(cases, benchCase{"ndots/" + name + suffix + "/" + dns.TypeToString[qtype], pkt, protoUDP})
			}
		}
	}
	for _, c := range cases {
		if n := testing.AllocsPerRun(100, func() {
			if handlePacket(w, c.pkt, out, c.proto) == nil {
				t.Fatalf("%s: no reply", c.name)
			}
		}); n != 0 {
			t.Errorf("%s: %v allocations per query, want 0", c.name, n)
		}
	}
}

type benchCase struct {
	name  string
	pkt   []byte
	proto proto
}
