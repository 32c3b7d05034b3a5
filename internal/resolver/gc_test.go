package resolver

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// The UDP readers wait in raw system calls holding their scheduler slots; the runtime
// must still reach them: garbage collections (stop-the-world) complete promptly while
// readers wait, queries are answered during them, and Shutdown stops the readers
// within their receive timeout.
func TestReadersYieldToRuntime(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	var gcs atomic.Int64
	var worst atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			runtime.GC()
			if d := int64(time.Since(start)); d > worst.Load() {
				worst.Store(d)
			}
			gcs.Add(1)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for i := range 200 {
		resp := exchange(t, "udp", ts.addr, query("productpage.ns1.svc.cluster.local.", dns.TypeA)())
		if len(resp.Answer) != 1 {
			t.Fatalf("query %d: %v", i, resp)
		}
	}
	// Idle readers (blocked with nothing to read) must not hold a collection up either.
	time.Sleep(300 * time.Millisecond)
	close(stop)
	<-done
	t.Logf("%d collections while serving and idle, slowest %s", gcs.Load(), time.Duration(worst.Load()))
	if w := time.Duration(worst.Load()); w > 150*time.Millisecond {
		t.Errorf("a garbage collection took %s: a reader held it up", w)
	}
	start := time.Now()
	if err := ts.s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > time.Second {
		t.Errorf("Shutdown took %s, want within the 250 ms receive timeout", el)
	}
}
