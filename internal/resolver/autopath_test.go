package resolver

import (
	"net/netip"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// External-name autopath is one decision for every query type: a known
// client's first search-suffix expansion of an external name is answered with
// a CNAME to the external name and that name's upstream answer, whether the
// query takes the wire path (A, AAAA) or the unpacked path (every other type,
// names the wire decoder does not take).
func TestExternalAutopathEveryType(t *testing.T) {
	tb := buildTable(t, []nametable.Host{
		{Name: "web.ns1.svc.cluster.local", Kubernetes: true, V4: []netip.Addr{netip.MustParseAddr("10.96.0.10")}},
	}, map[string]string{"127.0.0.3": "ns1"})
	start := func() *testServer {
		return startServerTable(t, tb, func(c *Config) { c.Authoritative = true })
	}
	const (
		ext      = "www.example.com.ns1.svc.cluster.local."
		extOrg   = "ext.example.org.ns1.svc.cluster.local."
		cname    = ext + " 30 IN CNAME www.example.com."
		orgSOA   = "example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300"
		rootSOA  = ". 300 IN SOA a.root. h.root. 1 2 3 4 300"
		known    = "127.0.0.3"
		opt1232  = "OPT udp=1232 do=false ver=0 ext=0 opts=0"
		bigTXT   = "big.example.org.ns1.svc.cluster.local."
		weird    = `we\(ird.example.org.ns1.svc.cluster.local.`
		apexName = "cluster.local.ns1.svc.cluster.local."
	)
	cases := []tcase{
		{name: "A", req: query(ext, dns.TypeA), client: known,
			an: []string{cname, "www.example.com. 300 IN CNAME edge.example.net.", "edge.example.net. 300 IN A 192.0.2.81"}},
		{name: "AAAA", req: query(ext, dns.TypeAAAA), client: known, an: []string{cname}, ns: []string{orgSOA}},
		{name: "MX", req: query(ext, dns.TypeMX), client: known, an: []string{cname}, ns: []string{orgSOA}},
		{name: "TXT", req: query(ext, dns.TypeTXT), client: known, an: []string{cname}, ns: []string{orgSOA}},
		{name: "SRV", req: query(ext, dns.TypeSRV), client: known, an: []string{cname}, ns: []string{orgSOA}},
		{name: "HTTPS", req: query(ext, dns.TypeHTTPS), client: known, an: []string{cname}, ns: []string{orgSOA}},
		// Names of their own: a cached answer's TTL counts down.
		{name: "A with EDNS", req: queryEDNS(extOrg, dns.TypeA, 1232, false), client: known, opt: opt1232,
			an: []string{extOrg + " 30 IN CNAME ext.example.org.", "ext.example.org. 300 IN A 192.0.2.80"}},
		{name: "MX with EDNS", req: queryEDNS(extOrg, dns.TypeMX, 1232, false), client: known, opt: opt1232,
			an: []string{extOrg + " 30 IN CNAME ext.example.org."}, ns: []string{orgSOA}},
		{name: "A of a name the wire decoder does not take", req: query(weird, dns.TypeA), client: known,
			rcode: dns.RcodeNameError, an: []string{weird + ` 30 IN CNAME we\(ird.example.org.`}, ns: []string{rootSOA}},
		{name: "TXT of an external name upstream NXDOMAIN", req: query("nope.example.org.ns1.svc.cluster.local.", dns.TypeTXT), client: known,
			rcode: dns.RcodeNameError, an: []string{"nope.example.org.ns1.svc.cluster.local. 30 IN CNAME nope.example.org."}, ns: []string{rootSOA}},
		// Not an external name: the cluster domain itself.
		{name: "A of the cluster domain expanded", req: query(apexName, dns.TypeA), client: known, aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
		{name: "TXT of the cluster domain expanded", req: query(apexName, dns.TypeTXT), client: known, aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
		// Not for a client the table does not know.
		{name: "MX from an unknown client", req: query(ext, dns.TypeMX), aa: true,
			rcode: dns.RcodeNameError, ns: []string{clusterSOA}},
	}
	runCasesPerNetwork(t, start, cases)

	// An expanded answer too large for UDP is truncated behind its CNAME.
	ts := start()
	resp := exchangeFrom(t, "udp", known, ts.addr, query(bigTXT, dns.TypeTXT)())
	if !resp.Truncated || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) == 0 {
		t.Fatalf("big TXT over UDP: %s", canon(resp))
	}
	if c, ok := resp.Answer[0].(*dns.CNAME); !ok || c.Target != "big.example.org." {
		t.Fatalf("big TXT over UDP: first answer %v, want the CNAME to big.example.org.", resp.Answer[0])
	}
	resp = exchangeFrom(t, "tcp", known, ts.addr, query(bigTXT, dns.TypeTXT)())
	if resp.Truncated || len(resp.Answer) != 41 {
		t.Fatalf("big TXT over TCP: TC=%v, %d answers, want the CNAME and 40 TXT", resp.Truncated, len(resp.Answer))
	}
}

// The tap shows an external autopath answer as autopath, from the cache or the
// upstream, on either path.
func TestExternalAutopathInTheTap(t *testing.T) {
	hub := tap.NewHub(1, 64)
	ts := startServer(t, testFile(), func(c *Config) { c.Authoritative, c.Tap = true, hub })
	sub, err := hub.Subscribe(tap.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	const name = "www.example.com.ns3.svc.cluster.local." // 127.0.0.2 is in ns3
	for _, qtype := range []uint16{dns.TypeA, dns.TypeMX} {
		for _, pass := range []string{"upstream", "cache"} {
			resp := exchangeFrom(t, "udp", "127.0.0.2", ts.addr, query(name, qtype)())
			if len(resp.Answer) == 0 || resp.Answer[0].Header().Rrtype != dns.TypeCNAME {
				t.Fatalf("%s %s: no CNAME: %s", dns.Type(qtype), pass, canon(resp))
			}
			if ev := nextEvent(t, sub); ev.Answer != tap.Autopath || ev.Name() != name || ev.Qtype != qtype {
				t.Errorf("%s from the %s: event %s %s %s, want autopath", dns.Type(qtype), pass, ev.Name(), dns.Type(ev.Qtype), ev.Answer)
			}
		}
	}
}
