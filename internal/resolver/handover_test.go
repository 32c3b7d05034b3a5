package resolver

import (
	"context"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"
)

// A successor serves the predecessor's sockets (Files -> Config.Inherited) while
// the predecessor drains with quiet 0: every query sent throughout, on fresh
// sockets, is answered by one of them; OnDequeue counts every read, empty
// probe datagrams included, which are not answered.
func TestHandoverServesInheritedSockets(t *testing.T) {
	var deqA, deqB atomic.Int64
	a := startServer(t, nil, func(c *Config) { c.OnDequeue = func(n int) { deqA.Add(int64(n)) } })

	// Queries on fresh sockets, as clients send them, until stopped.
	stop := make(chan struct{})
	var sent, answered atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := &dns.Client{Net: "udp", Timeout: 2 * time.Second}
			for {
				select {
				case <-stop:
					return
				default:
				}
				m := new(dns.Msg)
				m.SetQuestion("ext.example.org.", dns.TypeA)
				sent.Add(1)
				if r, _, err := c.Exchange(m, a.addr); err == nil && len(r.Answer) == 1 {
					answered.Add(1)
				}
			}
		}()
	}
	waitSent := func(n int64) {
		t.Helper()
		base := answered.Load()
		deadline := time.Now().Add(10 * time.Second)
		for answered.Load() < base+n && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitSent(200)

	files, err := a.s.Files()
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	b, err := New(Config{
		Listen:     []string{a.addr},
		Table:      a.table,
		Forwarder:  newForwarder(t, a.up.addr, reg),
		Inherited:  files,
		OnDequeue:  func(n int) { deqB.Add(int64(n)) },
		OnReaders:  raiseProcs,
		Registerer: reg,
		Logger:     slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer b.Shutdown(context.Background())
	if got := b.Addrs(); len(got) != 1 || got[0] != a.addr {
		t.Fatalf("successor bound %v, want the inherited %s", got, a.addr)
	}
	waitSent(200)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.s.Drain(ctx, 0); err != nil {
		t.Fatalf("Drain: %v", err)
	}
	aAfterDrain := deqA.Load()
	waitSent(500)
	close(stop)
	wg.Wait()
	if sent.Load() != answered.Load() {
		t.Errorf("%d queries sent, %d answered: the handover lost queries", sent.Load(), answered.Load())
	}
	if deqA.Load() != aAfterDrain {
		t.Errorf("the drained predecessor kept reading (%d -> %d)", aAfterDrain, deqA.Load())
	}
	t.Logf("%d queries across the handover, all answered; read by the predecessor %d, by the successor %d", sent.Load(), deqA.Load(), deqB.Load())

	// An empty datagram is a liveness probe: read and counted, not answered.
	before := deqB.Load()
	c, err := net.Dial("udp", a.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(nil); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := c.Read(make([]byte, 512)); err == nil {
		t.Errorf("the probe got a %d-byte reply", n)
	}
	if deqB.Load() != before+1 {
		t.Errorf("the probe was counted %d times, want 1", deqB.Load()-before)
	}
}

// Drain with a quiet period keeps serving until nothing was read for that long.
func TestDrainWaitsForQuiet(t *testing.T) {
	a := startServer(t, nil, nil)
	c := &dns.Client{Net: "udp", Timeout: time.Second}
	m := new(dns.Msg)
	m.SetQuestion("ext.example.org.", dns.TypeA)
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- a.s.Drain(ctx, 200*time.Millisecond)
	}()
	// Queries every 50 ms for 600 ms keep the drain waiting and are answered.
	for time.Since(start) < 600*time.Millisecond {
		if _, _, err := c.Exchange(m, a.addr); err != nil {
			t.Fatalf("query %v into the drain: %v", time.Since(start).Round(time.Millisecond), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el < 700*time.Millisecond {
		t.Errorf("drain returned after %v, before 200 ms of quiet", el)
	}
}

// Drain answers what was read before it: forwards in flight over UDP and over
// a TCP connection, whose answers come after the drain began.
func TestDrainAnswersInFlight(t *testing.T) {
	ts := startServer(t, nil, nil)
	ts.up.SetDelay(300 * time.Millisecond)
	type sent struct {
		proto string
		c     net.Conn
	}
	var all []sent
	for _, proto := range []string{"udp", "tcp"} {
		m := new(dns.Msg)
		m.SetQuestion(proto+".example.org.", dns.TypeA)
		pkt, err := m.Pack()
		if err != nil {
			t.Fatal(err)
		}
		c, err := net.Dial(proto, ts.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if proto == "tcp" {
			pkt = append([]byte{byte(len(pkt) >> 8), byte(len(pkt))}, pkt...)
		}
		if _, err := c.Write(pkt); err != nil {
			t.Fatal(err)
		}
		all = append(all, sent{proto, c})
	}
	// Both are with the (slow) upstream when the drain begins.
	deadline := time.Now().Add(5 * time.Second)
	for ts.up.Count() < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	begin := time.Now()
	if err := ts.s.Drain(ctx, 0); err != nil {
		t.Fatalf("Drain: %v", err)
	}
	t.Logf("drain took %v", time.Since(begin).Round(time.Millisecond))
	for _, s := range all {
		_ = s.c.SetReadDeadline(time.Now().Add(2 * time.Second))
		buf := make([]byte, 4096)
		var n int
		var err error
		if s.proto == "udp" {
			n, err = s.c.Read(buf)
		} else if _, err = readFull(s.c, buf[:2]); err == nil {
			n, err = readFull(s.c, buf[:int(buf[0])<<8|int(buf[1])])
		}
		if err != nil {
			t.Errorf("%s: no answer after the drain: %v", s.proto, err)
			continue
		}
		resp := new(dns.Msg)
		if err := resp.Unpack(buf[:n]); err != nil {
			t.Errorf("%s: %v", s.proto, err)
			continue
		}
		if resp.Rcode != dns.RcodeNameError {
			t.Errorf("%s: rcode %s, want the upstream's NXDOMAIN", s.proto, dns.RcodeToString[resp.Rcode])
		}
	}
}

// A drain with a quiet period does not end while queries wait in a socket's
// queue, however long the readers have not run (a busy machine): here every
// reader is held up for 400 ms while queries queue behind it, and the drain's
// 100 ms quiet period passes meanwhile.
func TestDrainWaitsForQueued(t *testing.T) {
	var hold atomic.Bool
	ts := startServer(t, testFile(), func(c *Config) {
		c.OnDequeue = func(int) {
			if hold.Load() {
				time.Sleep(400 * time.Millisecond)
			}
		}
	})
	send := func(n int) []net.Conn {
		var cs []net.Conn
		for range n {
			c, err := net.Dial("udp", ts.addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			pkt, _ := query("productpage.ns1.svc.cluster.local.", dns.TypeA)().Pack()
			if _, err := c.Write(pkt); err != nil {
				t.Fatal(err)
			}
			cs = append(cs, c)
		}
		return cs
	}
	hold.Store(true)
	first := send(20) // from 20 source ports: every reader of the SO_REUSEPORT group takes some and is held up
	deadline := time.Now().Add(2 * time.Second)
	for ts.s.Progress() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	hold.Store(false)
	queued := send(10) // these wait in the sockets' queues
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ts.s.Drain(ctx, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	unanswered := 0
	for _, c := range append(first, queued...) {
		_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := c.Read(make([]byte, 512)); err != nil {
			unanswered++
		}
	}
	if unanswered > 0 {
		t.Errorf("%d of %d queries unanswered after the drain", unanswered, len(first)+len(queued))
	}
}
