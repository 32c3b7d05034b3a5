package upstream

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

func TestCachePolicy(t *testing.T) {
	reply := func(rcode int, answer, ns []dns.RR) respondFunc {
		return func(_ string, req *dns.Msg) []*dns.Msg {
			m := new(dns.Msg)
			m.SetRcode(req, rcode)
			m.RecursionAvailable = true
			m.Answer, m.Ns = answer, ns
			return []*dns.Msg{m}
		}
	}
	const name = "host.example.org."
	cases := []struct {
		name      string
		respond   respondFunc
		wantRcode int
		wantTTL   uint32 // TTL of every record of the first answer
		cached    bool
		hitType   string
	}{
		{"positive keeps ttl", reply(dns.RcodeSuccess, []dns.RR{mustRR("%s 300 IN A 192.0.2.1", name)}, nil), dns.RcodeSuccess, 300, true, "success"},
		{"positive min ttl over records", reply(dns.RcodeSuccess, []dns.RR{mustRR("%s 300 IN CNAME t.example.org.", name), mustRR("t.example.org. 120 IN A 192.0.2.1")}, nil), dns.RcodeSuccess, 120, true, "success"},
		{"ttl floor", reply(dns.RcodeSuccess, []dns.RR{mustRR("%s 1 IN A 192.0.2.1", name)}, nil), dns.RcodeSuccess, 5, true, "success"},
		{"ttl zero floored", reply(dns.RcodeSuccess, []dns.RR{mustRR("%s 0 IN A 192.0.2.1", name)}, nil), dns.RcodeSuccess, 5, true, "success"},
		{"ttl cap", reply(dns.RcodeSuccess, []dns.RR{mustRR("%s 86400 IN A 192.0.2.1", name)}, nil), dns.RcodeSuccess, 3600, true, "success"},
		{"nxdomain soa minimum", reply(dns.RcodeNameError, nil, []dns.RR{soa("example.org.", 600, 60)}), dns.RcodeNameError, 60, true, "denial"},
		{"nxdomain soa ttl below minimum", reply(dns.RcodeNameError, nil, []dns.RR{soa("example.org.", 45, 900)}), dns.RcodeNameError, 45, true, "denial"},
		{"negative cap", reply(dns.RcodeNameError, nil, []dns.RR{soa("example.org.", 86400, 86400)}), dns.RcodeNameError, 1800, true, "denial"},
		{"nodata with soa", reply(dns.RcodeSuccess, nil, []dns.RR{soa("example.org.", 300, 120)}), dns.RcodeSuccess, 120, true, "denial"},
		{"nxdomain without soa", reply(dns.RcodeNameError, nil, nil), dns.RcodeNameError, 0, false, ""},
		{"nodata without soa", reply(dns.RcodeSuccess, nil, []dns.RR{mustRR("example.org. 300 IN NS ns.example.org.")}), dns.RcodeSuccess, 300, false, ""},
		{"servfail", reply(dns.RcodeServerFailure, nil, nil), dns.RcodeServerFailure, 0, false, ""},
		{"refused", reply(dns.RcodeRefused, nil, nil), dns.RcodeRefused, 0, false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := startFake(t, tc.respond)
			f, reg, clk := testForwarder(t, NewConfig(up.addr))
			resp, src := forward(t, f, query(name, dns.TypeA, 1))
			if src != SourceUpstream || resp.Rcode != tc.wantRcode {
				t.Fatalf("first answer: source %q rcode %s, want upstream %s", src, dns.RcodeToString[resp.Rcode], dns.RcodeToString[tc.wantRcode])
			}
			for _, rr := range append(append([]dns.RR{}, resp.Answer...), resp.Ns...) {
				if rr.Header().Ttl != tc.wantTTL {
					t.Errorf("record %s: TTL %d, want %d", rr, rr.Header().Ttl, tc.wantTTL)
				}
			}
			clk.advance(time.Second)
			resp2, src2 := forward(t, f, query(name, dns.TypeA, 2))
			if resp2.Rcode != tc.wantRcode {
				t.Errorf("second answer rcode %s, want %s", dns.RcodeToString[resp2.Rcode], dns.RcodeToString[tc.wantRcode])
			}
			wantSrc, wantUp := SourceUpstream, 2
			if tc.cached {
				wantSrc, wantUp = SourceCache, 1
				if len(resp2.Answer) != len(resp.Answer) || len(resp2.Ns) != len(resp.Ns) {
					t.Errorf("cached answer has %d/%d records, want %d/%d", len(resp2.Answer), len(resp2.Ns), len(resp.Answer), len(resp.Ns))
				}
				for _, rr := range append(append([]dns.RR{}, resp2.Answer...), resp2.Ns...) {
					if rr.Header().Ttl != tc.wantTTL-1 {
						t.Errorf("cached record %s: TTL %d, want %d (aged 1s)", rr, rr.Header().Ttl, tc.wantTTL-1)
					}
				}
				if got := metrictest.Value(t, reg, "meshdns_cache_hits_total", "type", tc.hitType); got != 1 {
					t.Errorf("meshdns_cache_hits_total{type=%s} = %v, want 1", tc.hitType, got)
				}
			}
			if src2 != wantSrc || up.count() != wantUp {
				t.Errorf("second answer: source %q, upstream saw %d queries; want %q and %d", src2, up.count(), wantSrc, wantUp)
			}
			if got := metrictest.Value(t, reg, "meshdns_cache_misses_total"); got != float64(wantUp) {
				t.Errorf("meshdns_cache_misses_total = %v, want %d", got, wantUp)
			}
		})
	}
}

func TestCacheTTLDecreasesAndExpires(t *testing.T) {
	up := startFake(t, answerA(100))
	cfg := NewConfig(up.addr)
	cfg.StaleTTL = -1
	f, _, clk := testForwarder(t, cfg)
	steps := []struct {
		advance time.Duration
		wantSrc Source
		wantTTL uint32
	}{
		{0, SourceUpstream, 100},
		{30 * time.Second, SourceCache, 70},
		{69*time.Second + 500*time.Millisecond, SourceCache, 1},
		{time.Second, SourceUpstream, 100}, // expired
		{10 * time.Second, SourceCache, 90},
	}
	for i, s := range steps {
		clk.advance(s.advance)
		resp, src := forward(t, f, query("Ttl.Example.", dns.TypeA, uint16(i)))
		if src != s.wantSrc || len(resp.Answer) != 1 || resp.Answer[0].Header().Ttl != s.wantTTL {
			t.Fatalf("step %d: source %q answer %v; want %q with TTL %d", i, src, resp.Answer, s.wantSrc, s.wantTTL)
		}
	}
}

func TestCacheKey(t *testing.T) {
	cases := []struct {
		name   string
		first  *dns.Msg
		second *dns.Msg
		hit    bool
	}{
		{"same query other id", query("k.example.", dns.TypeA, 1), query("k.example.", dns.TypeA, 2), true},
		{"name case ignored and echoed", query("k.example.", dns.TypeA, 1), query("K.eXaMpLe.", dns.TypeA, 2), true},
		{"edns without do shares", query("k.example.", dns.TypeA, 1), query("k.example.", dns.TypeA, 2, "edns"), true},
		{"do bit", query("k.example.", dns.TypeA, 1), query("k.example.", dns.TypeA, 2, "do"), false},
		{"cd bit", query("k.example.", dns.TypeA, 1), query("k.example.", dns.TypeA, 2, "cd"), false},
		{"qtype", query("k.example.", dns.TypeA, 1), query("k.example.", dns.TypeAAAA, 2), false},
		{"qclass", query("k.example.", dns.TypeA, 1), query("k.example.", dns.TypeA, 2, "ch"), false},
		{"other name", query("k.example.", dns.TypeA, 1), query("k2.example.", dns.TypeA, 2), false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := startFake(t, answerA(300))
			f, _, _ := testForwarder(t, NewConfig(up.addr))
			forward(t, f, tc.first)
			_, src := forward(t, f, tc.second)
			wantSrc, wantUp := SourceUpstream, 2
			if tc.hit {
				wantSrc, wantUp = SourceCache, 1
			}
			if src != wantSrc || up.count() != wantUp {
				t.Errorf("second query: source %q, upstream saw %d; want %q and %d", src, up.count(), wantSrc, wantUp)
			}
		})
	}
}

func TestSingleflight(t *testing.T) {
	up := startFake(t, answerA(300))
	up.SetDelay(200 * time.Millisecond)
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Random 0x20 case per client: each must get its own question back.
			b := []byte("popular.example.")
			for j := range b {
				if rand.IntN(2) == 0 {
					b[j] = strings.ToUpper(string(b[j]))[0]
				}
			}
			req := query(string(b), dns.TypeA, uint16(1000+i))
			resp, src, err := forwardMsg(t, context.Background(), f, req)
			switch {
			case err != nil:
				errs <- err
			case resp.Id != req.Id || resp.Question[0].Name != req.Question[0].Name:
				errs <- fmt.Errorf("client %d got id %d question %s", req.Id, resp.Id, resp.Question[0].Name)
			case src != SourceUpstream || len(resp.Answer) != 1:
				errs <- fmt.Errorf("client %d: source %s answer %v", req.Id, src, resp.Answer)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := up.count(); got != 1 {
		t.Errorf("upstream saw %d queries for %d identical concurrent misses, want 1", got, n)
	}
}

func TestServeStale(t *testing.T) {
	up := startFake(t, answerA(60))
	cfg := NewConfig(up.addr)
	cfg.StaleTTL = 10 * time.Minute
	cfg.Timeout = time.Second
	cfg.AttemptTimeout = 300 * time.Millisecond
	f, reg, clk := testForwarder(t, cfg)
	forward(t, f, query("stale.example.", dns.TypeA, 1))

	// Expired, upstream answers SERVFAIL: stale answer with TTL 30.
	up.SetRespond(func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		return []*dns.Msg{m.SetRcode(req, dns.RcodeServerFailure)}
	})
	clk.advance(2 * time.Minute)
	resp, src := forward(t, f, query("stale.example.", dns.TypeA, 2))
	if src != SourceStale || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 || resp.Answer[0].Header().Ttl != StaleAnswerTTL {
		t.Fatalf("after SERVFAIL: source %q rcode %d answer %v; want stale answer with TTL %d", src, resp.Rcode, resp.Answer, StaleAnswerTTL)
	}

	// Upstream gone (connection refused): still stale, and the upstream is marked down.
	up.Close()
	start := time.Now()
	resp, src = forward(t, f, query("STALE.example.", dns.TypeA, 3))
	if src != SourceStale || len(resp.Answer) != 1 || resp.Answer[0].(*dns.A).A.String() != "192.0.2.1" {
		t.Fatalf("upstream down: source %q answer %v; want stale", src, resp.Answer)
	}
	if el := time.Since(start); el > cfg.Timeout+200*time.Millisecond {
		t.Errorf("stale answer took %s, want within the timeout %s", el, cfg.Timeout)
	}
	if h := f.Healthy(); h[0].Healthy {
		t.Errorf("upstream still healthy after refused: %+v", h[0])
	}
	// All upstreams down: stale is served at once, not after the 1 s timeout.
	start = time.Now()
	_, src = forward(t, f, query("stale.example.", dns.TypeA, 4))
	if el := time.Since(start); src != SourceStale || el > 250*time.Millisecond {
		t.Errorf("all upstreams down: source %q after %s, want stale at once", src, el)
	}
	if got := metrictest.Value(t, reg, "meshdns_cache_hits_total", "type", "stale"); got != 3 {
		t.Errorf("meshdns_cache_hits_total{type=stale} = %v, want 3", got)
	}

	// Past the stale window: SERVFAIL (error).
	clk.advance(cfg.StaleTTL)
	if resp, src, err := forwardMsg(t, context.Background(), f, query("stale.example.", dns.TypeA, 5)); err == nil {
		t.Errorf("past the stale window: got source %q answer %v, want an error", src, resp)
	}
}

func TestPrefetch(t *testing.T) {
	up := startFake(t, answerA(100))
	f, reg, clk := testForwarder(t, NewConfig(up.addr))
	popular, rare := query("popular.example.", dns.TypeA, 1), query("rare.example.", dns.TypeA, 2)
	forward(t, f, popular)
	forward(t, f, rare)
	// Hits while more than 10% of the TTL is left never prefetch.
	clk.advance(85 * time.Second)
	for range 2 * PrefetchMinHits {
		forward(t, f, popular)
	}
	// A prefetch registers its upstream resolution before the hit returns, so "none
	// started" is known at once: no resolution in flight, none counted.
	if n := inFlight(f); n != 0 || metrictest.Value(t, reg, "meshdns_cache_prefetch_total") != 0 || up.count() != 2 {
		t.Fatalf("hits above %d%% of the TTL: %d resolutions in flight, upstream saw %d queries; want none and 2", PrefetchPercent, n, up.count())
	}
	clk.advance(6 * time.Second) // 9 s of 100 left
	for i := range PrefetchMinHits {
		resp, src := forward(t, f, popular)
		if src != SourceCache || resp.Answer[0].Header().Ttl != 9 {
			t.Fatalf("hit %d near expiry: source %q TTL %d, want cache with 9", i, src, resp.Answer[0].Header().Ttl)
		}
	}
	waitFor(t, 2*time.Second, "the prefetch query", func() bool { return up.count() == 3 })
	forward(t, f, rare) // one hit near expiry: not popular, no prefetch
	if got := metrictest.Value(t, reg, "meshdns_cache_prefetch_total"); got != 1 {
		t.Errorf("unpopular entry was prefetched: %v prefetches, want only the popular one", got)
	}
	waitFor(t, time.Second, "the refreshed entry", func() bool {
		resp, src := forward(t, f, popular)
		return src == SourceCache && resp.Answer[0].Header().Ttl == 100
	})
	if got := metrictest.Value(t, reg, "meshdns_cache_prefetch_total"); got != 1 {
		t.Errorf("meshdns_cache_prefetch_total = %v, want 1", got)
	}
}

func TestCacheBounded(t *testing.T) {
	cases := []struct{ size, names, want int }{
		{16, 100, 16},
		{1000, 3000, 1000},
		{10, 5, 5},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.size), func(t *testing.T) {
			up := startFake(t, answerA(300))
			cfg := NewConfig(up.addr)
			cfg.CacheSize = tc.size
			f, reg, _ := testForwarder(t, cfg)
			for i := range tc.names {
				forward(t, f, query(fmt.Sprintf("n%d.example.", i), dns.TypeA, uint16(i)))
			}
			got := metrictest.Value(t, reg, "meshdns_cache_entries")
			if int(got) > tc.size || int(got) < tc.want*9/10 {
				t.Errorf("meshdns_cache_entries = %v after %d names, want <= %d and about %d", got, tc.names, tc.size, tc.want)
			}
			if ev := metrictest.Value(t, reg, "meshdns_cache_evictions_total"); int(ev)+int(got) != tc.names {
				t.Errorf("evictions %v + entries %v != %d names", ev, got, tc.names)
			}
			// The most recent name is still cached.
			if _, src := forward(t, f, query(fmt.Sprintf("n%d.example.", tc.names-1), dns.TypeA, 9)); src != SourceCache {
				t.Errorf("last inserted name: source %q, want cache", src)
			}
		})
	}
}

func TestCacheDisabled(t *testing.T) {
	up := startFake(t, answerA(300))
	cfg := NewConfig(up.addr)
	cfg.CacheSize = -1
	f, _, _ := testForwarder(t, cfg)
	for i := range 3 {
		if _, src := forward(t, f, query("nocache.example.", dns.TypeA, uint16(i))); src != SourceUpstream {
			t.Errorf("query %d: source %q, want upstream", i, src)
		}
	}
	if up.count() != 3 {
		t.Errorf("upstream saw %d queries, want 3", up.count())
	}
}

func TestHashKeyCaseInsensitive(t *testing.T) {
	for _, n := range []string{"a.example.", "xn--bcher-kva.example.", "MiXeD.CaSe.", "."} {
		if hashKey(n, 1, 1, 0) != hashKey(strings.ToLower(n), 1, 1, 0) || hashKey(n, 1, 1, 0) != hashKey(strings.ToUpper(n), 1, 1, 0) {
			t.Errorf("hashKey(%q) depends on case", n)
		}
		if hashKey(n, 1, 1, 0) == hashKey(n, 28, 1, 0) || hashKey(n, 1, 1, 0) == hashKey(n, 1, 1, flagDO) {
			t.Errorf("hashKey(%q) ignores type or flags", n)
		}
	}
}

// Cached serves exactly the hits Forward serves (same key, TTL, sections, metrics), and
// declines (counting nothing) what Forward must handle.
func TestCachedWire(t *testing.T) {
	up := startFake(t, answerA(100))
	cfg := NewConfig(up.addr)
	cfg.StaleTTL = time.Hour
	f, reg, clk := testForwarder(t, cfg)
	hits := func() float64 {
		return metrictest.Value(t, reg, "meshdns_cache_hits_total", "type", "success") +
			metrictest.Value(t, reg, "meshdns_cache_hits_total", "type", "denial")
	}
	cached := func(qtype uint16, do, cd bool) (Answer, bool) {
		return f.Cached(&Query{Name: "w.example.", Qtype: qtype, Qclass: dns.ClassINET, DO: do, CD: cd})
	}
	if _, ok := cached(dns.TypeA, false, false); ok {
		t.Fatal("Cached hit before anything was fetched")
	}
	forward(t, f, query("W.Example.", dns.TypeA, 1))
	forward(t, f, query("w.example.", dns.TypeAAAA, 2))
	base := hits()

	steps := []struct {
		name    string
		advance time.Duration
		qtype   uint16
		do, cd  bool
		ok      bool
		ttl     uint32
	}{
		{"positive", 0, dns.TypeA, false, false, true, 100},
		{"ttl counts down", 40 * time.Second, dns.TypeA, false, false, true, 60},
		{"denial (SOA minimum 60)", 0, dns.TypeAAAA, false, false, true, 20},
		{"do is another key", 0, dns.TypeA, true, false, false, 0},
		{"cd is another key", 0, dns.TypeA, false, true, false, 0},
		{"expired: stale belongs to Forward", 60 * time.Second, dns.TypeA, false, false, false, 0},
	}
	wantHits := base
	for _, s := range steps {
		clk.advance(s.advance)
		a, ok := cached(s.qtype, s.do, s.cd)
		if ok != s.ok {
			t.Fatalf("%s: ok = %v, want %v", s.name, ok, s.ok)
		}
		if ok {
			wantHits++
			if a.Source != SourceCache {
				t.Fatalf("%s: source %v, want cache", s.name, a.Source)
			}
			// The same hit through Forward (counted too) carries the same sections.
			req := query("w.example.", s.qtype, 7)
			resp, src := forward(t, f, req)
			wantHits++
			if src != SourceCache {
				t.Fatalf("%s: Forward source %q, want cache", s.name, src)
			}
			got := toMsg(t, req, a)
			if fmt.Sprint(got.Answer, got.Ns, got.Extra) != fmt.Sprint(resp.Answer, resp.Ns, resp.Extra) || got.Rcode != resp.Rcode {
				t.Fatalf("%s: Cached %v %v %v rcode %d; Forward %v %v %v rcode %d", s.name,
					got.Answer, got.Ns, got.Extra, got.Rcode, resp.Answer, resp.Ns, resp.Extra, resp.Rcode)
			}
			for _, rr := range append(got.Answer, got.Ns...) {
				if rr.Header().Ttl != s.ttl {
					t.Fatalf("%s: TTL %d, want %d", s.name, rr.Header().Ttl, s.ttl)
				}
			}
		}
		if h := hits(); h != wantHits {
			t.Fatalf("%s: cache hits metric %v, want %v", s.name, h, wantHits)
		}
	}
}

// The cache is capped in bytes. Large answers (64 KiB over TCP) cannot make
// it grow past CacheBytes, however many names are asked.
func TestCacheBytesCap(t *testing.T) {
	const records = 400 // ~ 400 x 60-byte TXT = 24 KiB per answer
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		for i := range records {
			m.Answer = append(m.Answer, mustRR("%s 300 IN TXT \"%s-%03d\"", req.Question[0].Name, strings.Repeat("x", 40), i))
		}
		if proto == "udp" {
			m.Truncate(EDNSBufferSize)
		}
		return []*dns.Msg{m}
	})
	cfg := NewConfig(up.addr)
	cfg.CacheBytes = 2 << 20
	f, reg, _ := testForwarder(t, cfg)
	for i := range 200 {
		resp, _ := forward(t, f, query(fmt.Sprintf("big%d.example.", i), dns.TypeTXT, uint16(i)))
		if len(resp.Answer) != records {
			t.Fatalf("answer %d has %d records, want %d", i, len(resp.Answer), records)
		}
	}
	used := metrictest.Value(t, reg, "meshdns_cache_bytes")
	n := metrictest.Value(t, reg, "meshdns_cache_entries")
	t.Logf("200 answers of ~%d KiB: cache holds %v entries, %.1f MiB (cap %d MiB)", 24, n, used/(1<<20), cfg.CacheBytes>>20)
	if used > float64(cfg.CacheBytes) || n >= 200 || n == 0 {
		t.Errorf("cache holds %v entries and %v bytes, want fewer than 200 and at most %d bytes", n, used, cfg.CacheBytes)
	}
	// The cap is exported, so an alert can tell a full cache: here it is full.
	capBytes := metrictest.Value(t, reg, "meshdns_cache_max_bytes")
	if capBytes > float64(cfg.CacheBytes) || capBytes < float64(cfg.CacheBytes)*0.99 || used < capBytes*0.8 {
		t.Errorf("meshdns_cache_max_bytes %v for --cache-bytes %d, cache at %v bytes: want the cap, and the cache near it", capBytes, cfg.CacheBytes, used)
	}
}

// inFlight is the number of upstream resolutions running.
func inFlight(f *Forwarder) int {
	f.flightMu.Lock()
	defer f.flightMu.Unlock()
	return len(f.flights)
}
