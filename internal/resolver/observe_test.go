package resolver

import (
	"net/netip"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/talkers"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// portSenders attributes a query to cgroup 1000+port, process 7: what the
// datapath's flow records would say.
func portSenders(src netip.AddrPort, tcp bool) (Sender, bool) {
	if tcp {
		return Sender{Cgroup: 50000 + uint64(src.Port()), PID: 7}, true
	}
	return Sender{Cgroup: 1000 + uint64(src.Port()), PID: 7}, true
}

// nextEvent waits for the tap's next event.
func nextEvent(t *testing.T, sub *tap.Sub) tap.Event {
	t.Helper()
	var ev tap.Event
	deadline := time.Now().Add(5 * time.Second)
	for !sub.Next(&ev) {
		if time.Now().After(deadline) {
			t.Fatal("no tap event within 5 s")
		}
		time.Sleep(time.Millisecond)
	}
	return ev
}

// Every answered query reaches the tap with its sender (from Senders), its
// question, rcode, where the answer came from, the upstream and the size, and
// is counted for its sender; whole messages in, events out.
func TestTapSeesEveryAnswer(t *testing.T) {
	hub := tap.NewHub(1, 64)
	tr, err := talkers.New(talkers.Config{Name: func(k workload.Key) workload.Identity {
		return workload.Identity{Workload: "cg"}
	}})
	if err != nil {
		t.Fatal(err)
	}
	ts := startServer(t, testFile(), func(c *Config) {
		c.Authoritative, c.Senders, c.Tap, c.Talkers = true, portSenders, hub, tr.Counter()
	})
	sub, err := hub.Subscribe(tap.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	for _, tc := range []struct {
		network, name string
		qtype         uint16
		rcode         int
		answer        tap.Answer
		upstream      bool
	}{
		{"udp", "reviews.ns2.svc.cluster.local.", dns.TypeA, dns.RcodeSuccess, tap.Table, false},
		{"udp", "Reviews.NS2.ns1.svc.cluster.local.", dns.TypeA, dns.RcodeSuccess, tap.Autopath, false},
		{"udp", "reviews.ns2.ns1.svc.cluster.local.", dns.TypeSRV, dns.RcodeSuccess, tap.Autopath, false},
		{"udp", "nope.ns1.svc.cluster.local.", dns.TypeA, dns.RcodeNameError, tap.Table, false},
		{"udp", "_http._tcp.reviews.ns2.svc.cluster.local.", dns.TypeSRV, dns.RcodeSuccess, tap.Table, false},
		{"udp", "ext.example.org.", dns.TypeA, dns.RcodeSuccess, tap.Upstream, true},
		{"udp", "ext.example.org.", dns.TypeA, dns.RcodeSuccess, tap.Cache, false},
		{"tcp", "nothere.example.org.", dns.TypeA, dns.RcodeNameError, tap.Upstream, true},
		{"tcp", "reviews.ns2.svc.cluster.local.", dns.TypeAAAA, dns.RcodeSuccess, tap.Table, false},
	} {
		req := new(dns.Msg)
		req.SetQuestion(tc.name, tc.qtype)
		pkt, _ := req.Pack()
		raw := exchangeRaw(t, tc.network, ts.addr, pkt)
		resp := new(dns.Msg)
		if err := resp.Unpack(raw); err != nil {
			t.Fatal(err)
		}
		ev := nextEvent(t, sub)
		want := dns.CanonicalName(tc.name)
		if ev.Name() != want || ev.Qtype != tc.qtype || int(ev.Rcode) != resp.Rcode || int(ev.Rcode) != tc.rcode || ev.Answer != tc.answer {
			t.Errorf("%s %s %s: event %s %s %s %s, want %s %s %s %s", tc.network, tc.name, dns.Type(tc.qtype),
				ev.Name(), dns.Type(ev.Qtype), dns.RcodeToString[int(ev.Rcode)], ev.Answer,
				want, dns.Type(tc.qtype), dns.RcodeToString[tc.rcode], tc.answer)
		}
		base := uint64(1000)
		if tc.network == "tcp" {
			base = 50000
		}
		if ev.Key.Cgroup != base+uint64(ev.Port) || ev.Key.PID != 7 || ev.Key.Addr != netip.MustParseAddr("127.0.0.1") || ev.TCP != (tc.network == "tcp") {
			t.Errorf("%s %s: sender %+v port %d tcp %v", tc.network, tc.name, ev.Key, ev.Port, ev.TCP)
		}
		if got := ev.Upstream.String(); tc.upstream && got != ts.up.addr || !tc.upstream && ev.Upstream.IsValid() {
			t.Errorf("%s: upstream %s", tc.name, got)
		}
		if int(ev.Size) != len(raw) || ev.Latency <= 0 {
			t.Errorf("%s: size %d (answer %d bytes), latency %d", tc.name, ev.Size, len(raw), ev.Latency)
		}
	}
	if n := sub.TakeLost(); n != 0 {
		t.Errorf("%d events lost", n)
	}
}

// A query the upstreams never answer is unanswered (Failed) in the tap,
// after the forwarder gave up.
func TestTapSeesUnanswered(t *testing.T) {
	hub := tap.NewHub(1, 64)
	ts := startServer(t, testFile(), func(c *Config) {
		c.Tap, c.Forwarder = hub, failingForwarder{}
	})
	sub, err := hub.Subscribe(tap.Filter{Unanswered: true})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	req := new(dns.Msg)
	req.SetQuestion("ext.example.org.", dns.TypeA)
	if resp := exchange(t, "udp", ts.addr, req); resp.Rcode != dns.RcodeServerFailure {
		t.Fatalf("rcode %s", dns.RcodeToString[resp.Rcode])
	}
	ev := nextEvent(t, sub)
	if ev.Answer != tap.Failed || ev.Name() != "ext.example.org." || ev.Key.Cgroup != 0 || ev.Key.Addr != netip.MustParseAddr("127.0.0.1") {
		t.Errorf("event %s %s sender %+v, want failed ext.example.org. from 127.0.0.1 without a cgroup", ev.Answer, ev.Name(), ev.Key)
	}
}
