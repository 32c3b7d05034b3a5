package upstream

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

// shareUpstream answers names under nx.test. NXDOMAIN with an SOA (cacheable for
// 300 s) and any other A query with one address for 30 s: the quiet workload's
// answers expire first, so the cache's own eviction (the soonest to end first)
// would take them before the noisy workload's denials.
func shareUpstream(_ string, req *dns.Msg) []*dns.Msg {
	m := new(dns.Msg)
	m.SetReply(req)
	m.RecursionAvailable = true
	q := req.Question[0]
	if strings.HasSuffix(q.Name, ".nx.test.") {
		m.Rcode = dns.RcodeNameError
		m.Ns = append(m.Ns, soa("nx.test.", 300, 300))
		return []*dns.Msg{m}
	}
	m.Answer = append(m.Answer, mustRR("%s 30 IN A 192.0.2.1", q.Name))
	return []*dns.Msg{m}
}

// forwardAs is forward for a query charged to workload owner.
func forwardAs(t *testing.T, f *Forwarder, owner uint64, req *dns.Msg) (*dns.Msg, Source) {
	t.Helper()
	q := toQuery(req)
	q.Owner = owner
	a, err := f.Forward(context.Background(), q)
	if err != nil {
		t.Fatalf("Forward %s: %v", req.Question[0].Name, err)
	}
	resp := toMsg(t, req, a)
	checkAnswers(t, req, resp)
	return resp, a.Source
}

// One workload's flood of distinct misses (a noisy pod's random names through its
// search path) takes at most its share of the cache: it evicts its own oldest
// answers, never another workload's, and the cache's memory stays the other
// workload's plus that share.
func TestWorkloadCacheShare(t *testing.T) {
	const quiet, noisy = 1, 2
	up := startFake(t, shareUpstream)
	cfg := NewConfig(up.addr)
	cfg.CacheBytes = 1 << 20
	cfg.CacheWorkloadBytes = 64 << 10
	f, reg, _ := testForwarder(t, cfg)

	var quietNames []string
	for i := range 20 {
		n := fmt.Sprintf("svc%d.example.", i)
		quietNames = append(quietNames, n)
		forwardAs(t, f, quiet, query(n, dns.TypeA, uint16(i)))
	}
	quietBytes := metrictest.Value(t, reg, "meshdns_cache_bytes")

	const flood = 3000 // ~1.2 MB of denials: more than the whole cache
	for i := range flood {
		resp, _ := forwardAs(t, f, noisy, query(fmt.Sprintf("r%d.nx.test.", i), dns.TypeA, uint16(i)))
		if resp.Rcode != dns.RcodeNameError {
			t.Fatalf("r%d.nx.test.: rcode %s, want NXDOMAIN", i, dns.RcodeToString[resp.Rcode])
		}
	}
	used := metrictest.Value(t, reg, "meshdns_cache_bytes")
	t.Logf("quiet workload %0.f bytes; after %d noisy misses the cache holds %.0f bytes, %.0f entries", quietBytes, flood,
		used, metrictest.Value(t, reg, "meshdns_cache_entries"))
	if max := quietBytes + float64(cfg.CacheWorkloadBytes); used > max {
		t.Errorf("cache holds %.0f bytes after the flood, want at most the quiet workload's %.0f plus the share %d", used, quietBytes, cfg.CacheWorkloadBytes)
	}
	for i, n := range quietNames {
		if _, src := forwardAs(t, f, quiet, query(n, dns.TypeA, uint16(100+i))); src != SourceCache {
			t.Errorf("quiet workload's %s after the flood: source %s, want cache", n, src)
		}
	}
	// The noisy workload's newest answer is cached: its oldest went first.
	if _, src := forwardAs(t, f, noisy, query(fmt.Sprintf("r%d.nx.test.", flood-1), dns.TypeA, 7)); src != SourceCache {
		t.Errorf("noisy workload's newest name: source %s, want cache", src)
	}
	if ev := metrictest.Value(t, reg, "meshdns_cache_workload_evictions_total"); ev < flood/2 {
		t.Errorf("meshdns_cache_workload_evictions_total = %v after %d misses over a %d-byte share, want most of them", ev, flood, cfg.CacheWorkloadBytes)
	}
}

// Workloads missing at once, with shard evictions and share evictions crossing:
// afterwards each owner's charged bytes are the entries the cache holds for it,
// within its share, and the cache's byte count is the sum of its entries.
func TestWorkloadCacheShareConcurrent(t *testing.T) {
	up := startFake(t, shareUpstream)
	cfg := NewConfig(up.addr)
	cfg.CacheBytes = 128 << 10 // the shards evict too
	cfg.CacheWorkloadBytes = 24 << 10
	f, _, _ := testForwarder(t, cfg)
	const owners, names = 6, 400
	done := make(chan struct{})
	for o := range owners {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range names {
				q := toQuery(query(fmt.Sprintf("w%d-%d.nx.test.", o, i%(names/2+o*10)), dns.TypeA, uint16(i)))
				q.Owner = uint64(o + 1)
				if _, err := f.Forward(context.Background(), q); err != nil {
					t.Errorf("owner %d name %d: %v", o+1, i, err)
					return
				}
			}
		}()
	}
	for range owners {
		<-done
	}
	c := f.cache
	held := map[uint64]int{}
	total, n := 0, 0
	for i := range c.shards {
		for _, e := range c.shards[i].m {
			held[e.owner] += e.size()
			total += e.size()
			n++
		}
	}
	if int64(total) != c.bytes.Load() || int64(n) != c.entries.Load() {
		t.Errorf("the shards hold %d entries, %d bytes; the cache counts %d, %d", n, total, c.entries.Load(), c.bytes.Load())
	}
	for o := uint64(1); o <= owners; o++ {
		if got := c.shares.owned(o); got != held[o] || got > cfg.CacheWorkloadBytes {
			t.Errorf("owner %d charged %d bytes, holds %d in the cache; share %d", o, got, held[o], cfg.CacheWorkloadBytes)
		}
	}
}

// The share follows CacheBytes (set after NewConfig, as the agent does) unless set;
// negative is no cap.
func TestWorkloadCacheShareDefault(t *testing.T) {
	up := startFake(t, shareUpstream)
	for _, tc := range []struct {
		workload int
		want     float64
	}{{0, (1 << 20) / DefaultCacheWorkloadParts}, {4096, 4096}, {-1, 0}} {
		cfg := NewConfig(up.addr)
		cfg.CacheBytes = 1 << 20
		cfg.CacheWorkloadBytes = tc.workload
		_, reg, _ := testForwarder(t, cfg)
		if got := metrictest.Value(t, reg, "meshdns_cache_workload_max_bytes"); got != tc.want {
			t.Errorf("CacheWorkloadBytes %d with CacheBytes 1 MiB: meshdns_cache_workload_max_bytes %v, want %v", tc.workload, got, tc.want)
		}
	}
}
