package resolver

import (
	"net"
	"net/netip"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// TestAnswerAddrsReadsTheFinalAddresses: the A and AAAA records of an answer,
// behind a CNAME chain and compressed names, with their smallest TTL; none for
// NXDOMAIN, NODATA or a truncated message.
func TestAnswerAddrsReadsTheFinalAddresses(t *testing.T) {
	q := new(dns.Msg)
	q.SetQuestion("www.example.com.", dns.TypeA)
	rr := func(s string) dns.RR {
		r, err := dns.NewRR(s)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	chain := new(dns.Msg)
	chain.SetReply(q)
	chain.Compress = true
	chain.Answer = []dns.RR{rr("www.example.com. 300 IN CNAME edge.example.net."), rr("edge.example.net. 60 IN A 198.18.0.1"),
		rr("edge.example.net. 30 IN A 198.18.0.2"), rr("edge.example.net. 90 IN AAAA 2001:db8::1")}
	nx := new(dns.Msg)
	nx.SetRcode(q, dns.RcodeNameError)
	nodata := new(dns.Msg)
	nodata.SetReply(q)
	pack := func(m *dns.Msg) []byte {
		b, err := m.Pack()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	full := pack(chain)
	for _, tc := range []struct {
		name    string
		resp    []byte
		want    []string
		wantTTL uint32
	}{
		{"cname chain", full, []string{"198.18.0.1", "198.18.0.2", "2001:db8::1"}, 30},
		{"nxdomain", pack(nx), nil, 0},
		{"nodata", pack(nodata), nil, 0},
		{"cut in the last record", full[:len(full)-5], []string{"198.18.0.1", "198.18.0.2"}, 30},
		{"header only", full[:12], nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf [maxGrantAddrs]netip.Addr
			got, ttl := answerAddrs(tc.resp, buf[:])
			var s []string
			for _, a := range got {
				s = append(s, a.String())
			}
			if !slices.Equal(s, tc.want) || ttl != tc.wantTTL {
				t.Errorf("got %v ttl %d, want %v ttl %d", s, ttl, tc.want, tc.wantTTL)
			}
		})
	}
}

// grantCall is one call of the grant step.
type grantCall struct {
	wl    uint32
	name  string
	addrs []string
	ttl   time.Duration
}

// recordingGranter records the grant step's calls.
type recordingGranter struct {
	mu    sync.Mutex
	calls []grantCall
	hold  chan struct{} // non-nil: each call waits for it to be closed
	in    chan struct{} // signalled when a call starts
}

func (g *recordingGranter) grant(wl uint32, name string, addrs []netip.Addr, ttl time.Duration) (bool, error) {
	c := grantCall{wl: wl, name: name, ttl: ttl}
	for _, a := range addrs {
		c.addrs = append(c.addrs, a.String())
	}
	g.mu.Lock()
	g.calls = append(g.calls, c)
	hold, in := g.hold, g.in
	g.mu.Unlock()
	if in != nil {
		in <- struct{}{}
	}
	if hold != nil {
		<-hold
	}
	return true, nil
}

func (g *recordingGranter) take() []grantCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	c := g.calls
	g.calls = nil
	return c
}

// TestAnswersAreOfferedForGrantsBeforeTheyAreSent: every answer with addresses to
// a sender in an egress workload is offered to the grant step with the workload,
// the question's name (an autopath answer: the real name its CNAME names), the
// final addresses and the answer's TTL, whether it came from the table, the
// cache or the upstream, over UDP and TCP; negative answers are not; and the
// reply leaves only once the grant step returned.
func TestAnswersAreOfferedForGrantsBeforeTheyAreSent(t *testing.T) {
	g := &recordingGranter{}
	ts := startServer(t, testFile(), func(c *Config) {
		c.Authoritative = true
		c.Senders = func(src netip.AddrPort, tcp bool) (Sender, bool) { return Sender{Cgroup: 5, Egress: 9}, true }
		c.Grant = g.grant
	})
	for _, tc := range []struct {
		network, name string
		qtype         uint16
		want          []grantCall
	}{
		{"udp", "reviews.ns2.svc.cluster.local.", dns.TypeA,
			[]grantCall{{9, "reviews.ns2.svc.cluster.local.", []string{"10.0.2.1", "10.0.2.2", "10.0.2.3"}, 30 * time.Second}}},
		{"udp", "ratings.ns2.svc.cluster.local.", dns.TypeAAAA,
			[]grantCall{{9, "ratings.ns2.svc.cluster.local.", []string{"fd00::2:10"}, 30 * time.Second}}},
		{"udp", "Reviews.NS2.ns1.svc.cluster.local.", dns.TypeA,
			[]grantCall{{9, "reviews.ns2.svc.cluster.local.", []string{"10.0.2.1", "10.0.2.2", "10.0.2.3"}, 30 * time.Second}}},
		{"udp", "ext.example.org.", dns.TypeA, []grantCall{{9, "ext.example.org.", []string{"192.0.2.80"}, 300 * time.Second}}},
		{"udp", "ext.example.org.", dns.TypeA, nil}, // the cache: its TTL has counted down; checked below
		{"tcp", "www.example.com.", dns.TypeA, []grantCall{{9, "www.example.com.", []string{"192.0.2.81"}, 300 * time.Second}}},
		{"udp", "nope.ns1.svc.cluster.local.", dns.TypeA, nil},
		{"udp", "nothere.example.org.", dns.TypeA, nil},
		{"udp", "ext.example.org.", dns.TypeTXT, nil}, // NODATA
	} {
		req := new(dns.Msg)
		req.SetQuestion(tc.name, tc.qtype)
		pkt, _ := req.Pack()
		exchangeRaw(t, tc.network, ts.addr, pkt)
		got := g.take()
		if tc.want == nil && tc.name == "ext.example.org." && tc.qtype == dns.TypeA {
			// A cache hit: granted like the upstream's answer, for what is left of its TTL.
			if len(got) != 1 || got[0].name != "ext.example.org." || got[0].ttl > 300*time.Second || got[0].ttl < 290*time.Second {
				t.Errorf("%s %s from the cache: grant calls %+v, want one for ext.example.org. with the remaining TTL", tc.network, tc.name, got)
			}
			continue
		}
		sortAddrs := func(cs []grantCall) {
			for i := range cs {
				slices.Sort(cs[i].addrs)
			}
		}
		sortAddrs(got)
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s %s %s: grant calls %+v, want %+v", tc.network, tc.name, dns.TypeToString[tc.qtype], got, tc.want)
		}
	}

	t.Run("reply waits for the grant", func(t *testing.T) {
		hold := make(chan struct{})
		g.mu.Lock()
		g.hold, g.in = hold, make(chan struct{}, 1)
		in := g.in
		g.mu.Unlock()
		c, err := net.Dial("udp", ts.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		req := new(dns.Msg)
		req.SetQuestion("productpage.ns1.svc.cluster.local.", dns.TypeA)
		pkt, _ := req.Pack()
		if _, err := c.Write(pkt); err != nil {
			t.Fatal(err)
		}
		select {
		case <-in: // the grant step runs
		case <-time.After(5 * time.Second):
			close(hold)
			t.Fatal("the answer was not offered to the grant step")
		}
		buf := make([]byte, 512)
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if n, err := c.Read(buf); err == nil {
			t.Fatalf("a reply (%d bytes) left before the grant step returned", n)
		}
		close(hold)
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(buf); err != nil {
			t.Fatalf("no reply after the grant step returned: %v", err)
		}
	})
}

// TestNoGrantWithoutAnEgressWorkload: a sender the datapath found in no egress
// workload costs the grant step nothing.
func TestNoGrantWithoutAnEgressWorkload(t *testing.T) {
	g := &recordingGranter{}
	ts := startServer(t, testFile(), func(c *Config) {
		c.Senders = func(netip.AddrPort, bool) (Sender, bool) { return Sender{Cgroup: 5}, true }
		c.Grant = g.grant
	})
	req := new(dns.Msg)
	req.SetQuestion("reviews.ns2.svc.cluster.local.", dns.TypeA)
	pkt, _ := req.Pack()
	exchangeRaw(t, "udp", ts.addr, pkt)
	if got := g.take(); len(got) != 0 {
		t.Errorf("grant calls %+v for a sender without an egress workload", got)
	}
}
