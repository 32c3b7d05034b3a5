package resolver

import (
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
