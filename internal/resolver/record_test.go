package resolver

import (
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/talkers"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// recordForwarder is a scripted Forwarder: names starting with "cached" are in the
// cache ("cachedmany" with 40 addresses), "fail" fails, "hold" waits for release,
// anything else is answered at once by the upstream 127.0.0.9:53.
type recordForwarder struct {
	mu   sync.Mutex
	held []func()
}

func (f *recordForwarder) answer(q *upstream.Query) upstream.Answer {
	n := 1
	if strings.HasPrefix(q.Name, "cachedmany") {
		n = 40
	}
	buf := make([]byte, 0, 4096)
	for i := range n {
		rr := &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: []byte{192, 0, 2, byte(i + 1)}}
		b := make([]byte, 64)
		off, err := dns.PackRR(rr, b, 0, nil, false)
		if err != nil {
			panic(err)
		}
		buf = append(buf, b[:off]...)
	}
	return upstream.Answer{Records: buf, Answer: uint16(n), RecursionAvailable: true,
		Source: upstream.SourceUpstream, Server: netip.MustParseAddrPort("127.0.0.9:53")}
}

func (f *recordForwarder) Cached(q *upstream.Query) (upstream.Answer, bool) {
	if !strings.HasPrefix(q.Name, "cached") {
		return upstream.Answer{}, false
	}
	a := f.answer(q)
	a.Source = upstream.SourceCache
	return a, true
}

func (f *recordForwarder) ForwardAsync(q *upstream.Query, done upstream.Waiter) {
	switch {
	case strings.HasPrefix(q.Name, "fail"):
		done(upstream.Answer{}, upstream.ErrAllFailed)
	case strings.HasPrefix(q.Name, "hold"):
		a := f.answer(q)
		f.mu.Lock()
		f.held = append(f.held, func() { done(a, nil) })
		f.mu.Unlock()
	default:
		done(f.answer(q), nil)
	}
}

// release answers every held query.
func (f *recordForwarder) release() {
	f.mu.Lock()
	held := f.held
	f.held = nil
	f.mu.Unlock()
	for _, fn := range held {
		fn()
	}
}

// recordHarness serves whole messages through one worker of a server with every
// observer on (metrics, tap, talkers) and counts what each observer saw.
type recordHarness struct {
	t       *testing.T
	s       *Server
	w       *worker
	fwd     *recordForwarder
	reg     *prometheus.Registry
	tracker *talkers.Tracker
	sub     *tap.Sub
	replies chan []byte
	out     []byte
}

func newRecordHarness(t *testing.T) *recordHarness {
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	st := &staticTable{}
	st.t.Store(tb)
	h := &recordHarness{t: t, fwd: &recordForwarder{}, reg: prometheus.NewRegistry(),
		replies: make(chan []byte, 64), out: make([]byte, dns.MaxMsgSize)}
	// A window that never slides during the test (it moves only when told to).
	h.tracker, err = talkers.New(talkers.Config{Namespaces: true, Period: time.Second, Window: 1000 * time.Second, Name: func(workload.Key) workload.Identity {
		return workload.Identity{Workload: "w", Namespace: "rec"}
	}})
	if err != nil {
		t.Fatal(err)
	}
	h.reg.MustRegister(h.tracker)
	hub := tap.NewHub(1, 256)
	h.s, err = New(Config{Listen: []string{"127.0.0.1:0"}, Table: st, Forwarder: h.fwd, Registerer: h.reg,
		Logger: slog.New(slog.DiscardHandler), Authoritative: true, FilterAAAA: true,
		MaxPending: 4, MaxPendingPerClient: 3, WorkloadBudget: BudgetLimits{InFlight: 2},
		Tap: hub, Talkers: h.tracker.Counter()})
	if err != nil {
		t.Fatal(err)
	}
	if h.sub, err = hub.Subscribe(tap.Filter{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.sub.Close)
	h.w = newWorker(h.s)
	return h
}

// client is a sender: its address, transport and cgroup (its workload).
func (h *recordHarness) client(addr string, p proto, cgroup uint64) *client {
	c := &client{proto: p, addr: netip.MustParseAddr(addr), port: 40000}
	c.who = workload.Key{Addr: c.addr, Cgroup: cgroup}
	c.reply.sync = h.replies
	return c
}

// counts is what every observer has seen so far.
type recordCounts struct {
	requests, responses, durations, dropped, talkers, unanswered float64
}

func (h *recordHarness) counts() recordCounts {
	t := h.t
	// Two moves bring everything counted so far into the tracker's totals.
	h.tracker.Move()
	h.tracker.Move()
	return recordCounts{
		requests:   metrictest.Sum(t, h.reg, "meshdns_dns_requests_total"),
		responses:  metrictest.Sum(t, h.reg, "meshdns_dns_responses_total"),
		durations:  metrictest.Sum(t, h.reg, "meshdns_dns_request_duration_seconds"),
		dropped:    metrictest.Sum(t, h.reg, "meshdns_dns_dropped_total"),
		talkers:    metrictest.Sum(t, h.reg, "meshdns_namespace_queries_total"),
		unanswered: metrictest.Sum(t, h.reg, "meshdns_top_workload_unanswered"),
	}
}

func pack(t *testing.T, m *dns.Msg) []byte {
	t.Helper()
	b, err := m.Pack()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func msgQuery(name string, qtype uint16, edns bool) *dns.Msg {
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	if edns {
		m.SetEdns0(1232, false)
	}
	return m
}

// recordSend is one message from one client.
type recordSend struct {
	c   *client
	pkt []byte
}

// recordStep is one exit of the query path: the messages that take it and what the
// tap must show for them (one event per answer, by kind; none for a drop).
type recordStep struct {
	name    string
	sends   []recordSend
	release bool // answer the held forwarded queries after sending
	dropped int
	kinds   []tap.Answer
	tc      bool // the answers are truncated
}

// Every exit of the query path records its query exactly once: the request and
// response counters, the latency histogram, the drop counter, the tap and the top
// talkers each see every message sent exactly once, whichever way it was answered.
func TestRecordOnce(t *testing.T) {
	h := newRecordHarness(t)
	udp := h.client("127.0.0.1", protoUDP, 1)
	tcp := h.client("127.0.0.1", protoTCP, 1)
	known := h.client("127.0.0.2", protoUDP, 1) // in ns3: external autopath
	wa, wb := h.client("127.0.0.10", protoUDP, 11), h.client("127.0.0.10", protoUDP, 12)
	wc := h.client("127.0.0.11", protoUDP, 13)
	q := func(c *client, name string, qtype uint16) recordSend {
		return recordSend{c, pack(t, msgQuery(name, qtype, true))}
	}
	notify := msgQuery("reviews.ns2.svc.cluster.local.", dns.TypeSOA, false)
	notify.Opcode = dns.OpcodeNotify
	chaos := msgQuery("hostname.bind.", dns.TypeTXT, false)
	chaos.Question[0].Qclass = dns.ClassCHAOS
	formErrResp := msgQuery("x.example.org.", dns.TypeA, false)
	formErrResp.Response, formErrResp.Rcode = true, dns.RcodeFormatError
	steps := []recordStep{
		{name: "table", sends: []recordSend{q(udp, "reviews.ns2.svc.cluster.local.", dns.TypeA)}, kinds: []tap.Answer{tap.Table}},
		{name: "table NXDOMAIN", sends: []recordSend{q(udp, "nope.ns1.svc.cluster.local.", dns.TypeA)}, kinds: []tap.Answer{tap.Table}},
		{name: "table NODATA", sends: []recordSend{q(udp, "productpage.ns1.svc.cluster.local.", dns.TypeAAAA)}, kinds: []tap.Answer{tap.Table}},
		{name: "table SRV (unpacked)", sends: []recordSend{q(udp, "_http._tcp.reviews.ns2.svc.cluster.local.", dns.TypeSRV)}, kinds: []tap.Answer{tap.Table}},
		{name: "table wildcard", sends: []recordSend{q(udp, "a.wild.example.com.", dns.TypeA)}, kinds: []tap.Answer{tap.Table}},
		{name: "table truncated", sends: []recordSend{{udp, pack(t, msgQuery("headless.ns2.svc.cluster.local.", dns.TypeA, false))}}, kinds: []tap.Answer{tap.Table}, tc: true},
		{name: "autopath", sends: []recordSend{q(udp, "reviews.ns2.ns1.svc.cluster.local.", dns.TypeA)}, kinds: []tap.Answer{tap.Autopath}},
		{name: "autopath SRV (unpacked)", sends: []recordSend{q(udp, "reviews.ns2.ns1.svc.cluster.local.", dns.TypeSRV)}, kinds: []tap.Answer{tap.Autopath}},
		{name: "external autopath", sends: []recordSend{q(known, "www.example.com.ns3.svc.cluster.local.", dns.TypeA)}, kinds: []tap.Answer{tap.Autopath}},
		{name: "external autopath TXT (unpacked)", sends: []recordSend{q(known, "www.example.com.ns3.svc.cluster.local.", dns.TypeTXT)}, kinds: []tap.Answer{tap.Autopath}},
		{name: "AAAA filter", sends: []recordSend{q(udp, "ext.example.org.", dns.TypeAAAA)}, kinds: []tap.Answer{tap.Table}},
		{name: "cache", sends: []recordSend{q(udp, "cached.example.org.", dns.TypeA)}, kinds: []tap.Answer{tap.Cache}},
		{name: "cache TXT (unpacked)", sends: []recordSend{q(udp, "cached.example.org.", dns.TypeTXT)}, kinds: []tap.Answer{tap.Cache}},
		{name: "cache truncated", sends: []recordSend{{udp, pack(t, msgQuery("cachedmany.example.org.", dns.TypeA, false))}}, kinds: []tap.Answer{tap.Cache}, tc: true},
		{name: "forward", sends: []recordSend{q(udp, "fwd.example.org.", dns.TypeA)}, kinds: []tap.Answer{tap.Upstream}},
		{name: "forward TXT (unpacked)", sends: []recordSend{q(udp, "fwd.example.org.", dns.TypeTXT)}, kinds: []tap.Answer{tap.Upstream}},
		{name: "forward fails", sends: []recordSend{q(udp, "fail.example.org.", dns.TypeA)}, kinds: []tap.Answer{tap.Failed}},
		{name: "forward fails (unpacked)", sends: []recordSend{q(udp, "fail.example.org.", dns.TypeMX)}, kinds: []tap.Answer{tap.Failed}},
		{name: "TCP table", sends: []recordSend{q(tcp, "reviews.ns2.svc.cluster.local.", dns.TypeA)}, kinds: []tap.Answer{tap.Table}},
		{name: "TCP forward", sends: []recordSend{q(tcp, "fwd2.example.org.", dns.TypeA)}, kinds: []tap.Answer{tap.Upstream}},
		{name: "FORMERR (does not unpack)", sends: []recordSend{{udp, []byte{0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 3}}}, kinds: []tap.Answer{tap.Error}},
		{name: "NOTIMP", sends: []recordSend{{udp, pack(t, notify)}}, kinds: []tap.Answer{tap.Error}},
		{name: "REFUSED class", sends: []recordSend{{udp, pack(t, chaos)}}, kinds: []tap.Answer{tap.Error}},
		{name: "drop: no header", sends: []recordSend{{udp, []byte{0, 1, 2, 3, 4}}}, dropped: 1},
		{name: "drop: FORMERR response", sends: []recordSend{{udp, pack(t, formErrResp)}}, dropped: 1},
		{name: "held and throttled", sends: []recordSend{q(wa, "hold1.example.org.", dns.TypeA), q(wa, "hold2.example.org.", dns.TypeA), q(wa, "hold3.example.org.", dns.TypeA)},
			kinds: []tap.Answer{tap.Throttled}},
		{name: "shed: the client's share", sends: []recordSend{q(wb, "hold4.example.org.", dns.TypeA), q(wb, "hold5.example.org.", dns.TypeTXT)},
			kinds: []tap.Answer{tap.Shed}},
		{name: "shed: the total", sends: []recordSend{q(wc, "hold6.example.org.", dns.TypeA), q(wc, "hold7.example.org.", dns.TypeA)},
			kinds: []tap.Answer{tap.Shed}, release: true},
	}
	// The held queries (hold1, hold2, hold4, hold6) are answered by the last step.
	steps[len(steps)-1].kinds = append(steps[len(steps)-1].kinds, tap.Upstream, tap.Upstream, tap.Upstream, tap.Upstream)
	start, sent := h.counts(), 0
	for _, st := range steps {
		sent += len(st.sends)
		before := h.counts()
		var replies [][]byte
		for _, m := range st.sends {
			if b := h.w.serve(m.pkt, h.out, m.c, time.Now()); b != nil {
				replies = append(replies, slices.Clone(b))
			}
		}
		if st.release {
			h.fwd.release()
		}
		for len(h.replies) > 0 {
			replies = append(replies, <-h.replies)
		}
		var events []tap.Event
		for {
			var ev tap.Event
			if !h.sub.Next(&ev) {
				break
			}
			events = append(events, ev)
		}
		after := h.counts()
		h.check(st, before, after, replies, events)
	}
	if n := h.sub.TakeLost(); n != 0 {
		t.Errorf("the tap lost %d events", n)
	}
	if got := h.counts().requests - start.requests; got != float64(sent) {
		t.Errorf("meshdns_dns_requests_total counted %v requests, %d were sent", got, sent)
	}
}

// check compares what the observers saw during one step with the messages sent.
func (h *recordHarness) check(st recordStep, before, after recordCounts, replies [][]byte, events []tap.Event) {
	t := h.t
	answered, unanswered := len(st.kinds), 0
	for _, k := range st.kinds {
		if k.Unanswered() {
			unanswered++
		}
	}
	for _, c := range []struct {
		what      string
		got, want float64
	}{
		// A request is counted with its answer: a held query in the step that answers it.
		{"meshdns_dns_requests_total", after.requests - before.requests, float64(answered + st.dropped)},
		{"meshdns_dns_responses_total", after.responses - before.responses, float64(answered)},
		{"meshdns_dns_request_duration_seconds samples", after.durations - before.durations, float64(answered)},
		{"meshdns_dns_dropped_total", after.dropped - before.dropped, float64(st.dropped)},
		{"talkers' queries", after.talkers - before.talkers, float64(answered)},
		{"talkers' unanswered", after.unanswered - before.unanswered, float64(unanswered)},
		{"replies sent", float64(len(replies)), float64(answered)},
		{"tap events", float64(len(events)), float64(answered)},
	} {
		if c.got != c.want {
			t.Errorf("%s: %s counted %v times, want %v", st.name, c.what, c.got, c.want)
		}
	}
	var gotKinds, gotRcodes, wantRcodes []string
	for _, ev := range events {
		gotKinds = append(gotKinds, ev.Answer.String())
		gotRcodes = append(gotRcodes, dns.RcodeToString[int(ev.Rcode)])
	}
	var wantKinds []string
	for _, k := range st.kinds {
		wantKinds = append(wantKinds, k.String())
	}
	for _, b := range replies {
		m := new(dns.Msg)
		if err := m.Unpack(b); err != nil {
			wantRcodes = append(wantRcodes, fmt.Sprintf("rcode %d", b[3]&0xf))
			continue
		}
		wantRcodes = append(wantRcodes, dns.RcodeToString[m.Rcode])
		if m.Truncated != st.tc {
			t.Errorf("%s: TC %v, want %v", st.name, m.Truncated, st.tc)
		}
	}
	slices.Sort(gotKinds)
	slices.Sort(wantKinds)
	slices.Sort(gotRcodes)
	slices.Sort(wantRcodes)
	if !slices.Equal(gotKinds, wantKinds) {
		t.Errorf("%s: tap events %v, want %v", st.name, gotKinds, wantKinds)
	}
	if !slices.Equal(gotRcodes, wantRcodes) {
		t.Errorf("%s: tap rcodes %v, the replies' %v", st.name, gotRcodes, wantRcodes)
	}
}

// A message decodeWire reads part of before giving up (here an OPT whose extended
// rcode bits are set) is decoded from the unpacked message alone: its OPT is
// answered with ours and the table's answer, as for every message decodeWire does
// not take.
func TestDecodeWireGivesUpCleanly(t *testing.T) {
	h := newRecordHarness(t)
	pkt := pack(t, msgQuery("ProductPage.ns1.svc.cluster.local.", dns.TypeA, true))
	pkt[len(pkt)-11+5] = 1 // the OPT's upper rcode bits, in a query: not the common query
	b := h.w.serve(pkt, h.out, h.client("127.0.0.1", protoUDP, 1), time.Now())
	resp := new(dns.Msg)
	if err := resp.Unpack(b); err != nil {
		t.Fatal(err)
	}
	if resp.IsEdns0() == nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 || h.w.unpacked != 1 {
		t.Fatalf("response (unpacked %d):\n%s\nwant one A record and an OPT", h.w.unpacked, resp)
	}
}
