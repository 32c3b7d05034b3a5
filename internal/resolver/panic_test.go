package resolver

import (
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// panickyTable is a TableSource that panics while on.
type panickyTable struct {
	staticTable
	on atomic.Bool
}

func (p *panickyTable) Table() *nametable.Table {
	if p.on.Load() {
		panic("injected: table")
	}
	return p.staticTable.Table()
}

// panickyForwarder panics in ForwardAsync while on, and answers from next otherwise.
type panickyForwarder struct {
	next Forwarder
	on   atomic.Bool
}

func (p *panickyForwarder) Cached(q *upstream.Query) (upstream.Answer, bool) { return p.next.Cached(q) }
func (p *panickyForwarder) ForwardAsync(q *upstream.Query, done upstream.Waiter) {
	if p.on.Load() {
		panic("injected: forwarder")
	}
	p.next.ForwardAsync(q, done)
}

// servfailFor is the whole response a query gets when serving it panicked: SERVFAIL
// with the client's ID, flags and question, and an OPT when the query had one.
func servfailFor(req *dns.Msg) *dns.Msg {
	m := new(dns.Msg)
	m.SetRcode(req, dns.RcodeServerFailure)
	m.RecursionAvailable = true
	if o := req.IsEdns0(); o != nil {
		m.SetEdns0(ourUDPSize, o.Do())
	}
	return m
}

// TestPanicOnTheQueryPathAnswersServfail injects a panic at each stage a query runs
// code that can fail: the table, the forwarder, the attribution of the sender. The
// client gets SERVFAIL (or its answer, when only naming the sender failed), the panic
// is counted, and the same server answers the next query as before.
func TestPanicOnTheQueryPathAnswersServfail(t *testing.T) {
	table := &panickyTable{}
	fwd := &panickyForwarder{}
	var sendersPanic atomic.Bool
	ts := startServer(t, testFile(), func(c *Config) {
		table.t.Store(c.Table.Table())
		c.Table = table
		fwd.next = c.Forwarder
		c.Forwarder = fwd
		c.Senders = func(netip.AddrPort, bool) (Sender, bool) {
			if sendersPanic.Load() {
				panic("injected: senders")
			}
			return Sender{}, false
		}
		var err error
		if c.Panics, err = panicguard.New(c.Registerer, c.Logger); err != nil {
			t.Fatal(err)
		}
	})
	cases := []struct {
		name    string
		inject  *atomic.Bool
		network string
		req     *dns.Msg
		stage   string
		want    string // "servfail", or a string the answer contains
	}{
		{"table, wire path", &table.on, "udp", query("productpage.ns1.svc.cluster.local.", dns.TypeA)(), panicguard.StageServe, "servfail"},
		{"table, wire path with EDNS", &table.on, "udp", queryEDNS("productpage.ns1.svc.cluster.local.", dns.TypeA, 1232, true)(), panicguard.StageServe, "servfail"},
		{"table, TCP", &table.on, "tcp", query("productpage.ns1.svc.cluster.local.", dns.TypeA)(), panicguard.StageServe, "servfail"},
		{"table, unpacked path", &table.on, "udp", query(`we\(ird.ns1.svc.cluster.local.`, dns.TypeTXT)(), panicguard.StageServe, "servfail"},
		{"forwarder", &fwd.on, "udp", query("ext.example.org.", dns.TypeA)(), panicguard.StageServe, "servfail"},
		{"forwarder, unpacked path", &fwd.on, "tcp", query(`ex\(t.example.org.`, dns.TypeA)(), panicguard.StageServe, "servfail"},
		{"senders", &sendersPanic, "udp", query("productpage.ns1.svc.cluster.local.", dns.TypeA)(), panicguard.StageAttribution, "10.0.1.1"},
	}
	counted := map[string]float64{}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.inject.Store(true)
			resp := exchange(t, tc.network, ts.addr, tc.req)
			tc.inject.Store(false)
			counted[tc.stage]++
			if tc.want == "servfail" {
				if got, want := canon(resp), canon(servfailFor(tc.req)); got != want {
					t.Errorf("response\n%s\nwant\n%s", got, want)
				}
			} else if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) == 0 || !strings.Contains(resp.Answer[0].String(), tc.want) {
				t.Errorf("response %v, want an answer with %s", resp, tc.want)
			}
			if got := metrictest.Value(t, ts.reg, "meshdns_panics_total", "stage", tc.stage); got != counted[tc.stage] {
				t.Errorf("meshdns_panics_total{stage=%s} = %v, want %v", tc.stage, got, counted[tc.stage])
			}
			// The server goes on: the same query, without the fault, gets its answer.
			if after := exchange(t, tc.network, ts.addr, tc.req); after.Rcode == dns.RcodeServerFailure {
				t.Errorf("after the panic: %v", after)
			}
		})
	}
	if n := ts.s.limits.total.Load(); n != 0 {
		t.Errorf("%d pending upstream slots still held after the panics", n)
	}
}
