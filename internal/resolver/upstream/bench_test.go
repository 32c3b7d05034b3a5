package upstream

import (
	"context"
	"testing"

	"github.com/miekg/dns"
)

// BenchmarkCacheHit measures a cache hit (the hot path of the forwarded benchmark
// scenario): lookup, hit metric, and the answer as packed bytes.
func BenchmarkCacheHit(b *testing.B) {
	up := startFake(b, func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		n := req.Question[0].Name
		m.Answer = []dns.RR{mustRR("%s 3600 IN CNAME edge.example.net.", n), mustRR("edge.example.net. 3600 IN A 192.0.2.1"), mustRR("edge.example.net. 3600 IN A 192.0.2.2")}
		return []*dns.Msg{m}
	})
	f, _, _ := testForwarder(b, NewConfig(up.addr))
	q := &Query{Name: "www.example.com.", Qtype: dns.TypeA, Qclass: dns.ClassINET, ClientID: 42}
	if a, err := f.Forward(context.Background(), q); err != nil || a.Source != SourceUpstream {
		b.Fatalf("warm-up: %v %v", a.Source, err)
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			a, ok := f.Cached(q)
			if !ok || a.Answer != 3 {
				b.Fatalf("hit: %v %d", ok, a.Answer)
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			q := *q
			for pb.Next() {
				if _, ok := f.Cached(&q); !ok {
					b.Errorf("miss")
					return
				}
			}
		})
	})
}
