package resolver

import (
	"context"
	"net"
	"runtime"
	"slices"
	"sync"
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
	var mu sync.Mutex
	var durs []time.Duration
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
			mu.Lock()
			durs = append(durs, time.Since(start))
			mu.Unlock()
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
	slices.Sort(durs)
	median := durs[len(durs)/2]
	t.Logf("%d collections while serving and idle: median %s, slowest %s", len(durs), median, durs[len(durs)-1])
	// A reader that did not yield would hold every collection up to its 250 ms receive
	// timeout; the median is robust to the odd stall of a busy machine.
	if median > 100*time.Millisecond {
		t.Errorf("median garbage collection %s: a reader held them up", median)
	}
	start := time.Now()
	if err := ts.s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > time.Second {
		t.Errorf("Shutdown took %s, want within the 250 ms receive timeout", el)
	}
}

// Shutdown answers what is waiting for the upstream before it closes the sockets.
func TestShutdownDrainsPending(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	ts.up.SetDelay(300 * time.Millisecond)
	c, err := net.Dial("udp", ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	m := query("drain.example.net.", dns.TypeA)()
	pkt, _ := m.Pack()
	if _, err := c.Write(pkt); err != nil {
		t.Fatal(err)
	}
	// Shut down once the query is pending.
	deadline := time.Now().Add(2 * time.Second)
	for ts.s.limits.total.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := ts.s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 512)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("pending query not answered across Shutdown: %v", err)
	}
	resp := new(dns.Msg)
	if err := resp.Unpack(buf[:n]); err != nil || resp.Id != m.Id {
		t.Fatalf("answer %v %v", resp, err)
	}
}
