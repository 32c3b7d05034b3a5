package upstream

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
)

// flipHealth toggles the health flag of every server of f as fast as it can until
// stop is closed: the worst case of an upstream whose answers and timeouts alternate.
func flipHealth(f *Forwarder, stop <-chan struct{}, wg *sync.WaitGroup) {
	for _, s := range f.servers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				s.healthy.Store(!s.healthy.Load())
			}
		}()
	}
}

func TestOrderListsEveryUpstreamOnceWhileHealthFlips(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d upstreams", n), func(t *testing.T) {
			var servers []netip.AddrPort
			for i := range n {
				servers = append(servers, netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(5300+i)))
			}
			f, err := New(NewConfig(servers...)) // not started: order needs no socket
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			stop := make(chan struct{})
			var wg sync.WaitGroup
			flipHealth(f, stop, &wg)
			defer func() { close(stop); wg.Wait() }()

			for i := range 200_000 {
				got := f.order()
				seen := make(map[*server]int, n)
				for _, s := range got {
					seen[s]++
				}
				if len(got) != n || len(seen) != n {
					t.Fatalf("call %d: order() returned %d servers (%d distinct), want each of the %d once", i, len(got), len(seen), n)
				}
				for _, s := range got {
					if s == nil {
						t.Fatalf("call %d: order() returned a nil server", i)
					}
				}
			}
		})
	}
}

func TestResolutionsSurviveHealthFlips(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("%d upstreams", n), func(t *testing.T) {
			var servers []netip.AddrPort
			for range n {
				servers = append(servers, startFake(t, answerA(0)).addr)
			}
			cfg := NewConfig(servers...)
			cfg.CacheSize = -1 // every query is a resolution
			f, _, _ := testForwarder(t, cfg)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			flipHealth(f, stop, &wg)
			defer func() { close(stop); wg.Wait() }()

			var failed atomic.Int64
			var clients sync.WaitGroup
			deadline := time.Now().Add(2 * time.Second)
			for c := range 8 {
				clients.Add(1)
				go func() {
					defer clients.Done()
					for i := 0; time.Now().Before(deadline); i++ {
						req := query(fmt.Sprintf("q%d-%d.example.", c, i), dns.TypeA, uint16(i))
						if _, _, err := forwardMsg(t, t.Context(), f, req); err != nil {
							failed.Add(1)
						}
					}
				}()
			}
			clients.Wait()
			// Every upstream answers at once: health flags, however they flip, never
			// make a query fail.
			if n := failed.Load(); n != 0 {
				t.Errorf("%d resolutions failed while every upstream answered", n)
			}
		})
	}
}

// TestRateLimitingUpstreamStaysHealthy: an upstream that answers its quota and drops
// the excess is alive. Its dropped queries are counted as drops, not as an outage: it
// is never taken out of rotation, so its health never flaps.
func TestRateLimitingUpstreamStaysHealthy(t *testing.T) {
	up := startFake(t, dnsfake.RateLimited(answerA(0), 400, 2*time.Millisecond))
	cfg := NewConfig(up.addr)
	cfg.CacheSize = -1
	cfg.AttemptTimeout = 100 * time.Millisecond
	cfg.Timeout = 300 * time.Millisecond
	f, reg, _ := testForwarder(t, cfg)

	var answered, failed atomic.Int64
	var clients sync.WaitGroup
	deadline := time.Now().Add(3 * time.Second)
	for c := range 32 { // 32 clients in a loop: several times the upstream's quota
		clients.Add(1)
		go func() {
			defer clients.Done()
			for i := 0; time.Now().Before(deadline); i++ {
				req := query(fmt.Sprintf("r%d-%d.example.", c, i), dns.TypeA, uint16(i))
				if _, _, err := forwardMsg(t, t.Context(), f, req); err != nil {
					failed.Add(1)
				} else {
					answered.Add(1)
				}
			}
		}()
	}
	clients.Wait()
	t.Logf("answered %d, failed %d", answered.Load(), failed.Load())
	if failed.Load() == 0 {
		t.Fatalf("the upstream dropped nothing: the load did not exceed its quota")
	}
	name := up.addr.String()
	if got := metrictest.Value(t, reg, "meshdns_upstream_health_transitions_total", "upstream", name); got != 0 {
		t.Errorf("meshdns_upstream_health_transitions_total = %v, want 0: an upstream that answers its quota was taken out of rotation", got)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_failures_total", "upstream", name, "reason", "dropped"); got == 0 {
		t.Errorf(`meshdns_upstream_failures_total{reason="dropped"} = 0, want the dropped queries counted`)
	}
	if h := f.Healthy()[0]; !h.Healthy {
		t.Errorf("upstream unhealthy after the load: %+v", h)
	}
}

// TestSilentUpstreamGoesDown: an upstream that answered before and then answers
// nothing at all is taken out of rotation once its silence lasts SilenceForDown and
// MaxFails queries timed out.
func TestSilentUpstreamGoesDown(t *testing.T) {
	var mute atomic.Bool
	answer := answerA(0)
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		if mute.Load() {
			return nil
		}
		return answer(proto, req)
	})
	cfg := NewConfig(up.addr)
	cfg.CacheSize = -1
	cfg.AttemptTimeout = 50 * time.Millisecond
	cfg.Timeout = 100 * time.Millisecond
	f, reg, _ := testForwarder(t, cfg)
	forward(t, f, query("before.example.", dns.TypeA, 1))
	mute.Store(true)
	muted := time.Now()
	for i := 0; f.Healthy()[0].Healthy; i++ {
		if time.Since(muted) > SilenceForDown+5*time.Second {
			t.Fatalf("a silent upstream still healthy after %s", time.Since(muted))
		}
		if _, _, err := forwardMsg(t, t.Context(), f, query(fmt.Sprintf("s%d.example.", i), dns.TypeA, uint16(i))); err == nil {
			t.Fatalf("query %d to a silent upstream answered", i)
		}
	}
	if el := time.Since(muted); el < SilenceForDown {
		t.Errorf("taken out of rotation %s after it fell silent, before SilenceForDown (%s)", el, SilenceForDown)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_health_transitions_total", "upstream", up.addr.String()); got != 1 {
		t.Errorf("meshdns_upstream_health_transitions_total = %v, want 1", got)
	}
}

// TestPanicInAResolutionFailsItsWaiters: a panic in the goroutine of an upstream
// resolution is recovered and counted; every query waiting on it gets an error
// (the resolver answers SERVFAIL) and the forwarder keeps working.
func TestPanicInAResolutionFailsItsWaiters(t *testing.T) {
	reg := prometheus.NewRegistry()
	panics, err := panicguard.New(reg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	cfg := NewConfig(startFake(t, answerA(0)).addr)
	cfg.Panics = panics
	cfg.Registerer = reg
	f, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f.servers = nil // order() then panics: a stand-in for any bug in a resolution
	if err := f.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	for i := range 2 {
		_, _, err := forwardMsg(t, t.Context(), f, query(fmt.Sprintf("p%d.example.", i), dns.TypeA, 1))
		if !errors.Is(err, ErrPanic) {
			t.Fatalf("query %d: err = %v, want ErrPanic", i, err)
		}
		if got := metrictest.Value(t, reg, "meshdns_panics_total", "stage", panicguard.StageUpstream); got != float64(i+1) {
			t.Errorf("meshdns_panics_total{stage=upstream} = %v, want %d", got, i+1)
		}
	}
}
