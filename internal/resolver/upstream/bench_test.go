package upstream

import (
	"context"
	"testing"

	"github.com/miekg/dns"
)

// BenchmarkCacheHit measures Forward on a cache hit (the hot path of the forwarded
// benchmark scenario): lookup, hit metric, and the rendered answer.
func BenchmarkCacheHit(b *testing.B) {
	up := startFake(b, func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		n := req.Question[0].Name
		m.Answer = []dns.RR{mustRR("%s 3600 IN CNAME edge.example.net.", n), mustRR("edge.example.net. 3600 IN A 192.0.2.1"), mustRR("edge.example.net. 3600 IN A 192.0.2.2")}
		return []*dns.Msg{m}
	})
	cfg := NewConfig(up.addr)
	f, _, _ := testForwarder(b, cfg)
	req := query("www.Example.com.", dns.TypeA, 42, "edns")
	ctx := context.Background()
	if _, src, err := f.Forward(ctx, req); err != nil || src != SourceUpstream {
		b.Fatalf("warm-up: %q %v", src, err)
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			resp, src, err := f.Forward(ctx, req)
			if err != nil || src != SourceCache || len(resp.Answer) != 3 {
				b.Fatalf("hit: %q %v", src, err)
			}
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			r := req.Copy()
			for pb.Next() {
				if _, src, err := f.Forward(ctx, r); err != nil || src != SourceCache {
					b.Errorf("hit: %q %v", src, err)
					return
				}
			}
		})
	})
	b.Run("pack", func(b *testing.B) {
		// Forward plus packing the answer, as the server does before sending.
		b.ReportAllocs()
		buf := make([]byte, 0, 1232)
		for b.Loop() {
			resp, _, _ := f.Forward(ctx, req)
			if _, err := resp.PackBuffer(buf[:cap(buf)]); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("wire", func(b *testing.B) {
		// Cached, the resolver's UDP fast path: the hit as packed bytes.
		b.ReportAllocs()
		for b.Loop() {
			a, ok := f.Cached("www.example.com.", dns.TypeA, dns.ClassINET, false, false, 1200)
			if !ok || a.Answer != 3 {
				b.Fatalf("wire hit: %v %d", ok, a.Answer)
			}
		}
	})
}
