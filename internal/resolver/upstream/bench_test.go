package upstream

import (
	"context"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

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

// BenchmarkUpstreamMiss measures what one upstream resolution costs the process: each
// operation is a unique name (a cache miss) forwarded to a fake upstream on loopback,
// 16 in flight. Besides the time it reports the CPU time and the context switches
// of the whole process (the fake upstream's share included) per resolution.
func BenchmarkUpstreamMiss(b *testing.B) {
	up := startFake(b, answerA(300))
	f, _, _ := testForwarder(b, NewConfig(up.addr))
	slots := make(chan struct{}, 16)
	var failed atomic.Int64
	var ru0, ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	b.ResetTimer()
	i := 0
	for b.Loop() {
		slots <- struct{}{}
		q := &Query{Name: fmt.Sprintf("m%d.example.", i), Qtype: dns.TypeA, Qclass: dns.ClassINET, ClientID: 7}
		i++
		f.ForwardAsync(q, func(a Answer, err error) {
			if err != nil || a.Source != SourceUpstream {
				failed.Add(1)
			}
			<-slots
		})
	}
	for range cap(slots) {
		slots <- struct{}{}
	}
	b.StopTimer()
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	if n := failed.Load(); n > 0 {
		b.Fatalf("%d of %d resolutions failed", n, i)
	}
	cpu := time.Duration(syscall.TimevalToNsec(ru1.Utime) + syscall.TimevalToNsec(ru1.Stime) - syscall.TimevalToNsec(ru0.Utime) - syscall.TimevalToNsec(ru0.Stime))
	b.ReportMetric(float64(cpu.Microseconds())/float64(i), "cpu-µs/op")
	b.ReportMetric(float64(ru1.Nvcsw+ru1.Nivcsw-ru0.Nvcsw-ru0.Nivcsw)/float64(i), "ctxsw/op")
}

// BenchmarkCacheInsertFull measures an insert into a full cache of the default size
// (100,000 entries, 32 MiB): what an upstream answer costs the cache when the names
// keep changing. Its bytes per operation are garbage the collector must collect
// (at the agent's GOGC of 25, collections follow it closely).
func BenchmarkCacheInsertFull(b *testing.B) {
	c := newCache(DefaultCacheSize, DefaultCacheBytes, 0, 0)
	wire := make([]byte, 32)
	insert := func(i uint64) {
		h := i * 0x9e3779b97f4a7c15
		c.put(&entry{key: cacheKey{name: "n.example.", qtype: dns.TypeA, qclass: dns.ClassINET}, hash: h, wire: wire, exp: int64(i)})
	}
	var i uint64
	for ; i < DefaultCacheSize; i++ {
		insert(i)
	}
	if c.len() < DefaultCacheSize*9/10 {
		b.Fatalf("%d entries after filling, want about %d", c.len(), DefaultCacheSize)
	}
	b.ReportAllocs()
	for b.Loop() {
		insert(i)
		i++
	}
}
