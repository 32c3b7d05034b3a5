package resolver

import (
	"context"
	"net"
	"runtime"
	rtmetrics "runtime/metrics"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// stopPauses returns the runtime's histogram of how long stopping the world for a GC
// took (the time to bring every P to a safe point).
func stopPauses() *rtmetrics.Float64Histogram {
	sample := []rtmetrics.Sample{{Name: "/sched/pauses/stopping/gc:seconds"}}
	rtmetrics.Read(sample)
	return sample[0].Value.Float64Histogram()
}

// The UDP readers wait in raw system calls holding their scheduler slots; the runtime
// must still reach them: stopping the world for a collection takes no longer while
// readers wait (serving or idle), queries are answered meanwhile, and Shutdown stops
// the readers within their receive timeout.
func TestReadersYieldToRuntime(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	before := stopPauses()
	stop := make(chan struct{})
	done := make(chan struct{})
	var gcs int
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			runtime.GC()
			gcs++
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
	after := stopPauses()
	// The longest stop-the-world wait during the test: the upper bound of the highest
	// histogram bucket that gained counts. A reader that did not yield would hold
	// stops up to its 250 ms receive timeout.
	var worst float64
	for b := range after.Counts {
		if after.Counts[b] > before.Counts[b] {
			worst = after.Buckets[b+1]
		}
	}
	t.Logf("%d collections while serving and idle; longest wait to stop the world <= %s", gcs, time.Duration(worst*float64(time.Second)))
	if worst > 0.05 {
		t.Errorf("stopping the world took up to %s: a reader held it up", time.Duration(worst*float64(time.Second)))
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
