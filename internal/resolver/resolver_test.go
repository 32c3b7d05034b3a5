package resolver

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

const k8s = nametable.RegistryKubernetes

func headlessIPs() []string {
	var ips []string
	for i := 1; i <= 100; i++ {
		ips = append(ips, fmt.Sprintf("10.1.0.%d", i))
	}
	return ips
}

func testFile() *nametable.File {
	return &nametable.File{
		Table: map[string]nametable.HostInfo{
			"productpage.ns1.svc.cluster.local": {IPs: []string{"10.0.1.1"}, Registry: k8s},
			"reviews.ns2.svc.cluster.local": {IPs: []string{"10.0.2.1", "10.0.2.2", "10.0.2.3"}, Registry: k8s,
				Ports: []nametable.Port{{Name: "http", Port: 9080}, {Name: "grpc", Port: 9090}}},
			"reviews.ns3.svc.cluster.local":  {IPs: []string{"10.0.3.1"}, Registry: k8s},
			"ratings.ns2.svc.cluster.local":  {IPs: []string{"10.0.2.10", "fd00::2:10"}, Registry: k8s},
			"headless.ns2.svc.cluster.local": {IPs: headlessIPs(), Registry: k8s},
			"*.wild.example.com":             {IPs: []string{"192.0.2.9"}},
			"api.example.com":                {}, // auto-allocated VIP
		},
		Clients: map[string]string{"127.0.0.2": "ns3"},
	}
}

const clusterSOA = "cluster.local. 30 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 30"

// tcase is one query and the whole response expected for it.
type tcase struct {
	name   string
	req    func() *dns.Msg
	client string // local address to send from ("" = 127.0.0.1)
	rcode  int
	aa     bool
	an     []string
	ns     []string
	ar     []string
	opt    string // expected OPT line, "" = none
}

func query(name string, qtype uint16) func() *dns.Msg {
	return func() *dns.Msg {
		m := new(dns.Msg)
		m.SetQuestion(name, qtype)
		m.Id = 0x1234
		return m
	}
}

func queryEDNS(name string, qtype uint16, size uint16, do bool, opts ...dns.EDNS0) func() *dns.Msg {
	return func() *dns.Msg {
		m := query(name, qtype)()
		m.SetEdns0(size, do)
		o := m.IsEdns0()
		o.Option = append(o.Option, opts...)
		return m
	}
}

func (tc *tcase) expected(t *testing.T, req *dns.Msg) *dns.Msg {
	m := new(dns.Msg)
	m.Id = req.Id
	m.Response = true
	m.Opcode = req.Opcode
	m.RecursionDesired = req.RecursionDesired
	m.RecursionAvailable = true
	m.Authoritative = tc.aa
	m.Rcode = tc.rcode
	if len(req.Question) == 1 {
		m.Question = req.Question
	}
	for _, s := range tc.an {
		m.Answer = append(m.Answer, mustRR(t, s))
	}
	for _, s := range tc.ns {
		m.Ns = append(m.Ns, mustRR(t, s))
	}
	for _, s := range tc.ar {
		m.Extra = append(m.Extra, mustRR(t, s))
	}
	return m
}

// runCases sends every case over UDP, then over TCP, to one server. Cases
// with forwarded answers use runCasesPerNetwork.
func runCases(t *testing.T, ts *testServer, cases []tcase) {
	t.Helper()
	for _, network := range []string{"udp", "tcp"} {
		runCasesOver(t, ts, network, cases)
	}
}

// runCasesPerNetwork sends every case over UDP to one server from start and
// over TCP to another: a forwarded answer's TTL counts down in the cache, so a
// second pass to the same server would see 299 where the first saw 300 once a
// second had passed between them.
func runCasesPerNetwork(t *testing.T, start func() *testServer, cases []tcase) {
	t.Helper()
	for _, network := range []string{"udp", "tcp"} {
		runCasesOver(t, start(), network, cases)
	}
}

// runCasesOver sends every case over network and compares whole messages.
func runCasesOver(t *testing.T, ts *testServer, network string, cases []tcase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(network+"/"+tc.name, func(t *testing.T) {
			req := tc.req()
			var resp *dns.Msg
			if tc.client != "" {
				resp = exchangeFrom(t, network, tc.client, ts.addr, req)
			} else {
				resp = exchange(t, network, ts.addr, req)
			}
			want := canon(tc.expected(t, req))
			if tc.opt != "" {
				want += "AR " + tc.opt + "\n"
			}
			if got := canon(resp); got != want {
				t.Fatalf("response differs\n--- got\n%s--- want\n%s", got, want)
			}
		})
	}
}

func exchangeFrom(t *testing.T, network, local, addr string, req *dns.Msg) *dns.Msg {
	t.Helper()
	d := net.Dialer{Timeout: 2 * time.Second}
	if network == "udp" {
		d.LocalAddr = &net.UDPAddr{IP: net.ParseIP(local)}
	} else {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(local)}
	}
	conn, err := d.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	c := &dns.Conn{Conn: conn}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.WriteMsg(req); err != nil {
		t.Fatal(err)
	}
	resp, err := c.ReadMsg()
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func vipOf(t *testing.T, ts *testServer, host string) (netip.Addr, netip.Addr) {
	t.Helper()
	n := ts.table.Table().Lookup(host)
	if n == nil || !n.Host.AutoVIP {
		t.Fatalf("%s has no auto VIP", host)
	}
	return n.Host.V4[0], n.Host.V6[0]
}

// TestAnswers sends each case over UDP to one server and over TCP to another
// (runCasesPerNetwork).
func TestAnswers(t *testing.T) {
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	start := func() *testServer {
		return startServerTable(t, tb, func(c *Config) {
			c.Authoritative = true
			c.SearchDomains = []string{"corp.internal"}
		})
	}
	ts := start()
	vip4, vip6 := vipOf(t, ts, "api.example.com.")
	if !netip.MustParsePrefix("240.240.0.0/16").Contains(vip4) || !netip.MustParsePrefix("2001:2::/48").Contains(vip6) {
		t.Fatalf("VIPs %s %s outside the ranges", vip4, vip6)
	}
	var cases []tcase
	for _, group := range [][]tcase{nameCases(), autopathCases(vip4, vip6), nodataCases(), ptrCases(vip4, vip6), srvCases(), forwardCases()} {
		cases = append(cases, group...)
	}
	runCasesOver(t, ts, "udp", cases)
	runCasesOver(t, start(), "tcp", cases)
}

// testPP is the productpage Service of testFile.
const testPP = "productpage.ns1.svc.cluster.local."

// reviewsA is the A records of the reviews Service of testFile, at owner.
func reviewsA(owner string) []string {
	return []string{owner + " 30 IN A 10.0.2.1", owner + " 30 IN A 10.0.2.2", owner + " 30 IN A 10.0.2.3"}
}

// nameCases: Kubernetes alt names, bare names, wildcards.
func nameCases() []tcase {
	pp := testPP
	return []tcase{
		// Kubernetes alt names.
		{name: "fqdn", req: query(pp, dns.TypeA), aa: true, an: []string{pp + " 30 IN A 10.0.1.1"}},
		{name: "name.ns", req: query("reviews.ns2.", dns.TypeA), aa: true, an: reviewsA("reviews.ns2.")},
		{name: "name.ns.svc", req: query("reviews.ns2.svc.", dns.TypeA), aa: true, an: reviewsA("reviews.ns2.svc.")},
		{name: "bare unambiguous", req: query("productpage.", dns.TypeA), aa: true, an: []string{"productpage. 30 IN A 10.0.1.1"}},
		{name: "bare ambiguous is forwarded", req: query("reviews.", dns.TypeA), rcode: dns.RcodeNameError,
			ns: []string{". 300 IN SOA a.root. h.root. 1 2 3 4 300"}},
		{name: "bare from known client", req: query("reviews.", dns.TypeA), client: "127.0.0.2", aa: true,
			an: []string{"reviews. 30 IN A 10.0.3.1"}},
		{name: "bare from known client of another namespace", req: query("productpage.", dns.TypeA), client: "127.0.0.2",
			rcode: dns.RcodeNameError, ns: []string{". 300 IN SOA a.root. h.root. 1 2 3 4 300"}},
		{name: "wildcard", req: query("a.b.wild.example.com.", dns.TypeA), aa: true, an: []string{"a.b.wild.example.com. 30 IN A 192.0.2.9"}},
	}
}

// autopathCases: search-path queries answered with a CNAME to the name
// that exists; external names only for a known client's own namespace.
func autopathCases(vip4, vip6 netip.Addr) []tcase {
	pp := testPP
	return []tcase{
		// Autopath.
		{name: "autopath own namespace", req: query(pp+"ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: []string{pp + "ns1.svc.cluster.local. 30 IN CNAME " + pp, pp + " 30 IN A 10.0.1.1"}},
		{name: "autopath other namespace", req: query("reviews.ns2.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: append([]string{"reviews.ns2.ns1.svc.cluster.local. 30 IN CNAME reviews.ns2.svc.cluster.local."}, reviewsA("reviews.ns2.svc.cluster.local.")...)},
		{name: "autopath any namespace search domain", req: query("reviews.ns2.ns7.svc.cluster.local.", dns.TypeA), aa: true,
			an: append([]string{"reviews.ns2.ns7.svc.cluster.local. 30 IN CNAME reviews.ns2.svc.cluster.local."}, reviewsA("reviews.ns2.svc.cluster.local.")...)},
		{name: "autopath wildcard never targets *", req: query("x.wild.example.com.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: []string{"x.wild.example.com.ns1.svc.cluster.local. 30 IN CNAME x.wild.example.com.", "x.wild.example.com. 30 IN A 192.0.2.9"}},
		{name: "autopath svc.domain", req: query("api.example.com.svc.cluster.local.", dns.TypeA), aa: true,
			an: []string{"api.example.com.svc.cluster.local. 30 IN CNAME api.example.com.", "api.example.com. 30 IN A " + vip4.String()}},
		{name: "autopath domain AAAA", req: query("api.example.com.cluster.local.", dns.TypeAAAA), aa: true,
			an: []string{"api.example.com.cluster.local. 30 IN CNAME api.example.com.", "api.example.com. 30 IN AAAA " + vip6.String()}},
		{name: "autopath configured search domain", req: query("api.example.com.corp.internal.", dns.TypeA), aa: true,
			an: []string{"api.example.com.corp.internal. 30 IN CNAME api.example.com.", "api.example.com. 30 IN A " + vip4.String()}},
		{name: "no autopath to a bare name", req: query("ratings.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
		// Autopath for external names: only for a known client (127.0.0.2 is in ns3), only
		// its own namespace's search suffix.
		{name: "autopath external name", req: query("www.example.com.ns3.svc.cluster.local.", dns.TypeA), client: "127.0.0.2",
			an: []string{"www.example.com.ns3.svc.cluster.local. 30 IN CNAME www.example.com.",
				"www.example.com. 300 IN CNAME edge.example.net.", "edge.example.net. 300 IN A 192.0.2.81"}},
		{name: "autopath external NODATA", req: query("www.example.com.ns3.svc.cluster.local.", dns.TypeAAAA), client: "127.0.0.2",
			an: []string{"www.example.com.ns3.svc.cluster.local. 30 IN CNAME www.example.com."},
			ns: []string{"example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300"}},
		{name: "no external autopath for an unknown client", req: query("www.example.com.ns3.svc.cluster.local.", dns.TypeA), aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
		{name: "no external autopath for another namespace", req: query("www.example.com.ns1.svc.cluster.local.", dns.TypeA), client: "127.0.0.2", aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
	}
}

// nodataCases: NODATA and NXDOMAIN.
func nodataCases() []tcase {
	pp := testPP
	return []tcase{
		// NODATA and NXDOMAIN.
		{name: "AAAA of v4-only is NODATA", req: query(pp, dns.TypeAAAA), aa: true, ns: []string{clusterSOA}},
		{name: "AAAA dual stack", req: query("ratings.ns2.svc.cluster.local.", dns.TypeAAAA), aa: true,
			an: []string{"ratings.ns2.svc.cluster.local. 30 IN AAAA fd00::2:10"}},
		{name: "MX of known is NODATA", req: query(pp, dns.TypeMX), aa: true, ns: []string{clusterSOA}},
		{name: "HTTPS of external is NODATA", req: query("api.example.com.", dns.TypeHTTPS), aa: true,
			ns: []string{"api.example.com. 30 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 30"}},
		{name: "TXT of wildcard is NODATA", req: query("q.wild.example.com.", dns.TypeTXT), aa: true,
			ns: []string{"wild.example.com. 30 IN SOA ns.dns.cluster.local. hostmaster.cluster.local. 1 7200 1800 86400 30"}},
		{name: "authoritative NXDOMAIN", req: query("nope.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
		{name: "empty non-terminal", req: query("ns2.svc.cluster.local.", dns.TypeA), aa: true, ns: []string{clusterSOA}},
		{name: "apex SOA", req: query("cluster.local.", dns.TypeSOA), aa: true, an: []string{clusterSOA}},
	}
}

// ptrCases: reverse names of endpoints and auto VIPs.
func ptrCases(vip4, vip6 netip.Addr) []tcase {
	pp := testPP
	rev4, _ := dns.ReverseAddr(vip4.String())
	rev6, _ := dns.ReverseAddr(vip6.String())
	revRatings6, _ := dns.ReverseAddr("fd00::2:10")
	return []tcase{
		// PTR.
		{name: "PTR v4", req: query("1.1.0.10.in-addr.arpa.", dns.TypePTR), aa: true,
			an: []string{"1.1.0.10.in-addr.arpa. 30 IN PTR " + pp}},
		{name: "PTR v6", req: query(revRatings6, dns.TypePTR), aa: true,
			an: []string{revRatings6 + " 30 IN PTR ratings.ns2.svc.cluster.local."}},
		{name: "PTR auto VIP v4", req: query(rev4, dns.TypePTR), aa: true, an: []string{rev4 + " 30 IN PTR api.example.com."}},
		{name: "PTR auto VIP v6", req: query(rev6, dns.TypePTR), aa: true, an: []string{rev6 + " 30 IN PTR api.example.com."}},
		{name: "PTR unknown is forwarded", req: query("9.9.9.10.in-addr.arpa.", dns.TypePTR), rcode: dns.RcodeNameError,
			ns: []string{". 300 IN SOA a.root. h.root. 1 2 3 4 300"}},
	}
}

// srvCases: SRV of named ports.
func srvCases() []tcase {
	pp := testPP
	return []tcase{
		// SRV.
		{name: "SRV port", req: query("_http._tcp.reviews.ns2.svc.cluster.local.", dns.TypeSRV), aa: true,
			an: []string{"_http._tcp.reviews.ns2.svc.cluster.local. 30 IN SRV 0 100 9080 reviews.ns2.svc.cluster.local."},
			ar: reviewsA("reviews.ns2.svc.cluster.local.")},
		{name: "SRV port via alt name", req: query("_grpc._tcp.reviews.ns2.", dns.TypeSRV), aa: true,
			an: []string{"_grpc._tcp.reviews.ns2. 30 IN SRV 0 100 9090 reviews.ns2.svc.cluster.local."},
			ar: reviewsA("reviews.ns2.svc.cluster.local.")},
		{name: "SRV all ports", req: query("reviews.ns2.svc.cluster.local.", dns.TypeSRV), aa: true,
			an: []string{"reviews.ns2.svc.cluster.local. 30 IN SRV 0 100 9080 reviews.ns2.svc.cluster.local.",
				"reviews.ns2.svc.cluster.local. 30 IN SRV 0 100 9090 reviews.ns2.svc.cluster.local."},
			ar: reviewsA("reviews.ns2.svc.cluster.local.")},
		{name: "SRV without ports is NODATA", req: query(pp, dns.TypeSRV), aa: true, ns: []string{clusterSOA}},
		{name: "SRV unknown port", req: query("_nope._udp.reviews.ns2.svc.cluster.local.", dns.TypeSRV), aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
	}
}

// forwardCases: forwarding, 0x20 case, EDNS.
func forwardCases() []tcase {
	pp := testPP
	return []tcase{
		// Forwarding, case, EDNS.
		{name: "forwarded", req: query("ext.example.org.", dns.TypeA), an: []string{"ext.example.org. 300 IN A 192.0.2.80"}},
		{name: "forwarded NODATA", req: query("ext.example.org.", dns.TypeAAAA),
			ns: []string{"example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300"}},
		{name: "0x20 forwarded, upstream", req: query("CaSe.Example.ORG.", dns.TypeA),
			an: []string{"CaSe.Example.ORG. 300 IN CNAME edge.example.net.", "edge.example.net. 300 IN A 192.0.2.81"}},
		{name: "0x20 forwarded, cache", req: query("ExT.eXaMpLe.ORG.", dns.TypeA), an: []string{"ExT.eXaMpLe.ORG. 300 IN A 192.0.2.80"}},
		{name: "0x20 forwarded, unpacked path", req: query("StAr*.Example.ORG.", dns.TypeA), an: []string{"StAr*.Example.ORG. 300 IN A 192.0.2.82"}},
		{name: "0x20 case echoed", req: query("PrOdUcTpAgE.Ns1.SvC.cluster.LOCAL.", dns.TypeA), aa: true,
			an: []string{"PrOdUcTpAgE.Ns1.SvC.cluster.LOCAL. 30 IN A 10.0.1.1"}},
		{name: "0x20 autopath", req: query("Reviews.NS2.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: append([]string{"Reviews.NS2.ns1.svc.cluster.local. 30 IN CNAME reviews.ns2.svc.cluster.local."}, reviewsA("reviews.ns2.svc.cluster.local.")...)},
		{name: "EDNS DO echoed", req: queryEDNS(pp, dns.TypeA, 4096, true), aa: true,
			an: []string{pp + " 30 IN A 10.0.1.1"}, opt: "OPT udp=1232 do=true ver=0 ext=0 opts=0"},
		{name: "EDNS unknown option not echoed", req: queryEDNS(pp, dns.TypeAAAA, 1232, false,
			&dns.EDNS0_LOCAL{Code: 65001, Data: []byte{1, 2}}), aa: true,
			ns: []string{clusterSOA}, opt: "OPT udp=1232 do=false ver=0 ext=0 opts=0"},
		{name: "EDNS forwarded options stripped", req: queryEDNS("ext.example.org.", dns.TypeA, 1232, true),
			an: []string{"ext.example.org. 300 IN A 192.0.2.80"}, opt: "OPT udp=1232 do=true ver=0 ext=0 opts=0"},
	}
}

// Multiple addresses come back in varying order.
func TestShuffle(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	for _, network := range []string{"udp", "tcp"} {
		orders := map[string]bool{}
		for range 50 {
			resp := exchange(t, network, ts.addr, query("reviews.ns2.svc.cluster.local.", dns.TypeA)())
			var ips []string
			for _, rr := range resp.Answer {
				ips = append(ips, rr.(*dns.A).A.String())
			}
			orders[strings.Join(ips, ",")] = true
		}
		// 3 addresses have 6 orders; 50 tries that all hit one order would
		// mean no shuffling (probability 6 * (1/6)^50).
		if len(orders) < 2 {
			t.Fatalf("%s: one order in 50 responses: %v", network, orders)
		}
	}
}

// unpackedPath runs pkt through serve with the dns.Msg encoder rendering every
// decision.
func unpackedPath(w *worker, pkt, out []byte, addr netip.Addr) []byte {
	c := &client{proto: protoUDP, addr: addr}
	w.forceMsg = true
	defer func() { w.forceMsg = false }()
	return w.serve(pkt, out, c, time.Now())
}

// servePath runs pkt through serve and reports whether the wire path answered it.
func servePath(t *testing.T, w *worker, pkt []byte, addr netip.Addr) (*dns.Msg, bool) {
	t.Helper()
	before := w.unpacked
	out := make([]byte, maxUDPResponse)
	ch := make(chan []byte, 1)
	c := &client{proto: protoUDP, addr: addr}
	c.reply.sync = ch
	b := w.serve(pkt, out, c, time.Now())
	if b == nil {
		if !w.req.pending {
			t.Fatal("no answer")
		}
		b = <-ch
	}
	m := new(dns.Msg)
	if err := m.Unpack(b); err != nil {
		t.Fatalf("answer does not unpack: %v", err)
	}
	return m, w.unpacked == before
}

// The wire path and the unpacked path must agree on everything but the order of
// shuffled addresses.
func TestFastPathMatchesGeneralPath(t *testing.T) {
	ts := startServer(t, testFile(), func(c *Config) { c.Authoritative = true })
	w := newWorker(ts.s)
	names := []struct {
		name  string
		qtype uint16
		fast  bool
	}{
		{"productpage.ns1.svc.cluster.local.", dns.TypeA, true},
		{"PRODUCTPAGE.ns1.svc.cluster.local.", dns.TypeA, true},
		{"reviews.ns2.", dns.TypeA, true},
		{"productpage.", dns.TypeA, true},
		{"ratings.ns2.svc.cluster.local.", dns.TypeAAAA, true},
		{"reviews.ns2.ns1.svc.cluster.local.", dns.TypeA, true},
		{"api.example.com.corp.internal.", dns.TypeA, true}, // no search domains configured: forwarded, NXDOMAIN
		{"api.example.com.svc.cluster.local.", dns.TypeAAAA, true},
		{"x.wild.example.com.", dns.TypeA, true},                   // owned by the question
		{"productpage.ns1.svc.cluster.local.", dns.TypeAAAA, true}, // NODATA
		{"api.example.com.", dns.TypeAAAA, true},
		{"nope.ns1.svc.cluster.local.", dns.TypeA, true}, // NXDOMAIN
		{"www.Google.com.ns1.svc.cluster.local.", dns.TypeAAAA, true},
		{"ns2.svc.cluster.local.", dns.TypeA, true}, // empty non-terminal
		{"cluster.local.", dns.TypeA, true},
		{"nope.example.net.", dns.TypeA, true},
		{"headless.ns2.svc.cluster.local.", dns.TypeA, false}, // needs truncation
		{"ext.example.org.", dns.TypeA, true},
		{"_http._tcp.reviews.ns2.svc.cluster.local.", dns.TypeSRV, false},
	}
	client := netip.MustParseAddr("127.0.0.1")
	for _, n := range names {
		for _, edns := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/%d/edns=%v", n.name, n.qtype, edns), func(t *testing.T) {
				req := query(n.name, n.qtype)()
				if edns {
					req.SetEdns0(1400, true)
				}
				pkt, _ := req.Pack()
				// Twice: the first may be a cache miss answered later.
				servePath(t, w, pkt, client)
				fm, fast := servePath(t, w, pkt, client)
				if fast != n.fast {
					t.Fatalf("wire path taken = %v, want %v", fast, n.fast)
				}
				out := make([]byte, maxUDPResponse)
				b := unpackedPath(w, pkt, out, client)
				gm := new(dns.Msg)
				if err := gm.Unpack(b); err != nil {
					t.Fatal(err)
				}
				fc, gc := canon(fm), canon(gm)
				if fm.Truncated && gm.Truncated {
					// Which shuffled records survive truncation differs: compare the rest.
					fc, gc = fmt.Sprint(fm.MsgHdr, fm.Question, len(fm.Answer)), fmt.Sprint(gm.MsgHdr, gm.Question, len(gm.Answer))
				}
				if fc != gc {
					t.Fatalf("wire\n%s\nunpacked\n%s", fc, gc)
				}
			})
		}
	}
}

// Kubernetes semantics: ExternalName aliases, headless endpoints with SRV
// per endpoint, dual-stack Services, pod records, visibility.
func TestKubernetesAnswers(t *testing.T) {
	a := func(s ...string) []netip.Addr {
		var out []netip.Addr
		for _, x := range s {
			out = append(out, netip.MustParseAddr(x))
		}
		return out
	}
	tb := buildTable(t, []nametable.Host{
		{Name: "web.ns1.svc.cluster.local", Kubernetes: true, V4: a("10.96.0.10"), V6: a("fd00:10:96::10"),
			Ports: []nametable.HostPort{{Name: "http", Protocol: "tcp", Port: 80}}},
		{Name: "ext.ns1.svc.cluster.local", Kubernetes: true, Extra: &nametable.HostExtra{CNAME: "ext.example.org"}},
		{Name: "alias.ns1.svc.cluster.local", Kubernetes: true, Extra: &nametable.HostExtra{CNAME: "web.ns1.svc.cluster.local"}},
		{Name: "gone.ns1.svc.cluster.local", Kubernetes: true, Extra: &nametable.HostExtra{CNAME: "nothing.ns9.svc.cluster.local"}},
		{Name: "db.ns1.svc.cluster.local", Kubernetes: true, NoPTR: true, V4: a("10.244.1.5", "10.244.2.7"), Ports: []nametable.HostPort{
			{Name: "sql", Protocol: "tcp", Port: 5432, Target: "db-0.db.ns1.svc.cluster.local"},
			{Name: "sql", Protocol: "tcp", Port: 5432, Target: "10-244-2-7.db.ns1.svc.cluster.local"}}},
		{Name: "db-0.db.ns1.svc.cluster.local", V4: a("10.244.1.5")},
		{Name: "10-244-2-7.db.ns1.svc.cluster.local", V4: a("10.244.2.7")},
		{Name: "api.example.com", V4: a("192.0.2.50"), Extra: &nametable.HostExtra{Visible: []string{"ns1"}}},
	}, map[string]string{"127.0.0.3": "ns1"})
	start := func() *testServer {
		return startServerTable(t, tb, func(c *Config) { c.Authoritative = true; c.PodRecords = true })
	}
	cases := []tcase{
		{name: "dual-stack A", req: query("web.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: []string{"web.ns1.svc.cluster.local. 30 IN A 10.96.0.10"}},
		{name: "dual-stack AAAA", req: query("web.ns1.svc.cluster.local.", dns.TypeAAAA), aa: true,
			an: []string{"web.ns1.svc.cluster.local. 30 IN AAAA fd00:10:96::10"}},
		{name: "ExternalName chased upstream", req: query("ext.ns1.svc.cluster.local.", dns.TypeA),
			an: []string{"ext.ns1.svc.cluster.local. 30 IN CNAME ext.example.org.", "ext.example.org. 300 IN A 192.0.2.80"}},
		{name: "ExternalName CNAME query", req: query("ext.ns1.svc.cluster.local.", dns.TypeCNAME), aa: true,
			an: []string{"ext.ns1.svc.cluster.local. 30 IN CNAME ext.example.org."}},
		{name: "ExternalName to an in-table name", req: query("alias.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: []string{"alias.ns1.svc.cluster.local. 30 IN CNAME web.ns1.svc.cluster.local.", "web.ns1.svc.cluster.local. 30 IN A 10.96.0.10"}},
		{name: "ExternalName to a missing cluster name", req: query("gone.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			rcode: dns.RcodeNameError, an: []string{"gone.ns1.svc.cluster.local. 30 IN CNAME nothing.ns9.svc.cluster.local."}, ns: []string{clusterSOA}},
		{name: "ExternalName via autopath", req: query("ext.ns1.ns1.svc.cluster.local.", dns.TypeA),
			an: []string{"ext.ns1.ns1.svc.cluster.local. 30 IN CNAME ext.ns1.svc.cluster.local.",
				"ext.ns1.svc.cluster.local. 30 IN CNAME ext.example.org.", "ext.example.org. 300 IN A 192.0.2.80"}},
		{name: "headless endpoint by hostname", req: query("db-0.db.ns1.svc.cluster.local.", dns.TypeA), aa: true,
			an: []string{"db-0.db.ns1.svc.cluster.local. 30 IN A 10.244.1.5"}},
		{name: "headless SRV per endpoint", req: query("_sql._tcp.db.ns1.svc.cluster.local.", dns.TypeSRV), aa: true,
			an: []string{"_sql._tcp.db.ns1.svc.cluster.local. 30 IN SRV 0 100 5432 db-0.db.ns1.svc.cluster.local.",
				"_sql._tcp.db.ns1.svc.cluster.local. 30 IN SRV 0 100 5432 10-244-2-7.db.ns1.svc.cluster.local."},
			ar: []string{"db-0.db.ns1.svc.cluster.local. 30 IN A 10.244.1.5", "10-244-2-7.db.ns1.svc.cluster.local. 30 IN A 10.244.2.7"}},
		{name: "PTR of an endpoint", req: query("5.1.244.10.in-addr.arpa.", dns.TypePTR), aa: true,
			an: []string{"5.1.244.10.in-addr.arpa. 30 IN PTR db-0.db.ns1.svc.cluster.local."}},
		{name: "pod A record", req: query("10-244-1-9.ns1.pod.cluster.local.", dns.TypeA), aa: true,
			an: []string{"10-244-1-9.ns1.pod.cluster.local. 30 IN A 10.244.1.9"}},
		{name: "pod AAAA record", req: query("fd00-244--9.ns1.pod.cluster.local.", dns.TypeAAAA), aa: true,
			an: []string{"fd00-244--9.ns1.pod.cluster.local. 30 IN AAAA fd00:244::9"}},
		{name: "pod AAAA of a v4 pod is NODATA", req: query("10-244-1-9.ns1.pod.cluster.local.", dns.TypeAAAA), aa: true,
			ns: []string{clusterSOA}},
		{name: "pod name that is no address", req: query("x-y.ns1.pod.cluster.local.", dns.TypeA), aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
		{name: "host exported to ns1 only, known ns1 client", req: query("api.example.com.", dns.TypeA), client: "127.0.0.3", aa: true,
			an: []string{"api.example.com. 30 IN A 192.0.2.50"}},
		{name: "host exported to ns1 only, other client", req: query("api.example.com.", dns.TypeA),
			rcode: dns.RcodeNameError, ns: []string{". 300 IN SOA a.root. h.root. 1 2 3 4 300"}},
	}
	runCasesPerNetwork(t, start, cases)
}
