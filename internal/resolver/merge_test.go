package resolver

import (
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// gatedUpstream is a fake upstream that holds every answer until release is called:
// the test decides when the one resolution ends, after every client has asked. The
// answer is one A record owned by the lower-cased question name.
type gatedUpstream struct {
	*dnsfake.Server
	release func()
	fwdReg  *prometheus.Registry // the forwarder's metrics
}

func startGatedServer(t *testing.T) (*testServer, *gatedUpstream) {
	t.Helper()
	gate := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release) // never leave the fake's goroutines blocked
	up, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: func(_ string, r *dns.Msg) []*dns.Msg {
		<-gate
		m := new(dns.Msg)
		m.SetReply(r)
		m.RecursionAvailable = true
		q := r.Question[0]
		m.Answer = []dns.RR{&dns.A{
			Hdr: dns.RR_Header{Name: strings.ToLower(q.Name), Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 300},
			A:   net.IPv4(192, 0, 2, 44).To4(),
		}}
		if o := r.IsEdns0(); o != nil {
			m.SetEdns0(4096, o.Do())
		}
		return []*dns.Msg{m}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(up.Close)
	g := &gatedUpstream{Server: up, release: release, fwdReg: prometheus.NewRegistry()}
	// One attempt per resolution: the upstream is held for as long as the test
	// needs, and a retransmission to it would be a second upstream query that says
	// nothing about merging.
	f := newForwarder(t, up.Addr.String(), g.fwdReg, func(cfg *upstream.Config) {
		cfg.Timeout, cfg.AttemptTimeout = 20*time.Second, 20*time.Second
	})
	ts := startServer(t, testFile(), func(c *Config) { c.Forwarder = f })
	return ts, g
}

// misses is how many queries reached the forwarder without a cache hit: every
// waiter of a merged resolution counts.
func (g *gatedUpstream) misses(t *testing.T) float64 {
	return metrictest.Value(t, g.fwdReg, "meshdns_cache_misses_total")
}

// spell gives name a spelling of its own for i: the letters' case follows i's bits.
func spell(name string, i int) string {
	b := []byte(name)
	bit := 0
	for j, c := range b {
		if c >= 'a' && c <= 'z' {
			if i>>bit&1 == 1 {
				b[j] = c - 'a' + 'A'
			}
			bit++
		}
	}
	return string(b)
}

// mergedWant is the whole response a client of the merged resolution must get: its
// ID, its question as it spelled it, the answer owned by that spelling, our OPT when
// it sent one.
func mergedWant(t *testing.T, req *dns.Msg) string {
	want := (&tcase{rcode: dns.RcodeSuccess, an: []string{req.Question[0].Name + " 300 IN A 192.0.2.44"}}).expected(t, req)
	s := canon(want)
	if req.IsEdns0() != nil {
		s += fmt.Sprintf("AR OPT udp=%d do=false ver=0 ext=0 opts=0\n", ourUDPSize)
	}
	return s
}

// 1,000 clients, each on a UDP socket and address of its own, ask one uncached name at
// once, each with its own spelling and ID, half of them with EDNS. The upstream is
// asked once, and every client gets the whole answer with its own ID, its own spelling
// in the question and in the answer's owner.
func TestMergedMissesAnswerEachClient(t *testing.T) {
	ts, up := startGatedServer(t)
	const clients = 1000
	const name = "mergedname.example.org."
	server := net.UDPAddrFromAddrPort(mustAddrPort(ts.addr))
	conns := make([]*net.UDPConn, clients)
	reqs := make([]*dns.Msg, clients)
	for i := range clients {
		// Distinct addresses: each client has its own pending share, as pods do.
		local := &net.UDPAddr{IP: net.IPv4(127, 1, byte(i/200), byte(i%200+1))}
		c, err := net.DialUDP("udp", local, server)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns[i] = c
		m := new(dns.Msg)
		m.SetQuestion(spell(name, i), dns.TypeA)
		m.Id = uint16(0x4000 + i)
		if i%2 == 1 {
			m.SetEdns0(1232, false)
		}
		reqs[i] = m
	}
	for i, c := range conns {
		pkt, err := reqs[i].Pack()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(pkt); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return up.misses(t) >= clients },
		"the forwarder saw %v of %d queries", up.misses(t), clients)
	up.release()

	var wg sync.WaitGroup
	errs := make([]string, clients)
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			buf := make([]byte, 4096)
			n, err := c.Read(buf)
			if err != nil {
				errs[i] = fmt.Sprintf("no answer: %v", err)
				return
			}
			resp := new(dns.Msg)
			if err := resp.Unpack(buf[:n]); err != nil {
				errs[i] = fmt.Sprintf("unpack: %v", err)
				return
			}
			if got, want := canon(resp), mergedWant(t, reqs[i]); got != want {
				errs[i] = fmt.Sprintf("response differs\n--- got\n%s--- want\n%s", got, want)
			}
		}()
	}
	wg.Wait()
	bad := 0
	for i, e := range errs {
		if e != "" {
			if bad < 5 {
				t.Errorf("client %d (%s, id %#x): %s", i, reqs[i].Question[0].Name, reqs[i].Id, e)
			}
			bad++
		}
	}
	if bad > 0 {
		t.Errorf("%d of %d clients got no right answer", bad, clients)
	}
	if n := up.Count(); n != 1 {
		t.Errorf("upstream queries = %d, want 1 for %d identical concurrent misses", n, clients)
	}
}

// A client that retries a merged query (same ID, same socket) while its resolution is
// in flight gets an answer to the retry too: the retry joins the resolution, it is not
// dropped as a duplicate, and the upstream is still asked once.
func TestMergedRetryIsAnswered(t *testing.T) {
	ts, up := startGatedServer(t)
	c, err := net.DialUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 4, 1)}, net.UDPAddrFromAddrPort(mustAddrPort(ts.addr)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := new(dns.Msg)
	req.SetQuestion("Retry.Example.ORG.", dns.TypeA)
	req.Id = 0x7979
	pkt, err := req.Pack()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(pkt); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return up.Count() == 1 },
		"the upstream saw %d queries, want the first attempt's", up.Count())
	if _, err := c.Write(pkt); err != nil { // the client's retry, same ID and socket
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return up.misses(t) >= 2 },
		"the forwarder saw %v queries, want the retry too", up.misses(t))
	up.release()
	want := mergedWant(t, req)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 4096)
	for i := range 2 {
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("answer %d of 2 (the query and its retry): %v", i+1, err)
		}
		resp := new(dns.Msg)
		if err := resp.Unpack(buf[:n]); err != nil {
			t.Fatal(err)
		}
		if got := canon(resp); got != want {
			t.Errorf("answer %d differs\n--- got\n%s--- want\n%s", i+1, got, want)
		}
	}
	if n := up.Count(); n != 1 {
		t.Errorf("upstream queries = %d, want 1: the retry joins the resolution in flight", n)
	}
}
