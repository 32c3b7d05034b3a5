package resolver

import (
	"net/netip"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// aaaaFilterCases: with the AAAA filter on, AAAA of every name the table does not
// answer is NODATA with the cluster domain's SOA at once (never NOTIMP, never
// forwarded); table names and other types are answered as without it.
func aaaaFilterCases() []tcase {
	pp := testPP
	nodata := []string{clusterSOA}
	return []tcase{
		{name: "external AAAA", req: query("ext.example.org.", dns.TypeAAAA), ns: nodata},
		{name: "external AAAA keeps the client's case", req: query("Ext.EXAMPLE.org.", dns.TypeAAAA), ns: nodata},
		{name: "external AAAA with EDNS", req: queryEDNS("www.example.com.", dns.TypeAAAA, 1232, true), ns: nodata,
			opt: "OPT udp=1232 do=true ver=0 ext=0 opts=0"},
		{name: "external AAAA on the unpacked path", req: query("star*.example.org.", dns.TypeAAAA), ns: nodata},
		{name: "external autopath AAAA", req: query("www.example.com.ns3.svc.cluster.local.", dns.TypeAAAA), client: "127.0.0.2",
			an: []string{"www.example.com.ns3.svc.cluster.local. 30 IN CNAME www.example.com."}, ns: nodata},
		{name: "alias to an external name", req: query("ext.ns1.svc.cluster.local.", dns.TypeAAAA),
			an: []string{"ext.ns1.svc.cluster.local. 30 IN CNAME ext.example.org."}, ns: nodata},
		// The table answers as it does without the filter.
		{name: "table AAAA", req: query("ratings.ns2.svc.cluster.local.", dns.TypeAAAA), aa: true,
			an: []string{"ratings.ns2.svc.cluster.local. 30 IN AAAA fd00::2:10"}},
		{name: "table AAAA of a v4-only name", req: query(pp, dns.TypeAAAA), aa: true, ns: nodata},
		{name: "table autopath AAAA", req: query("ratings.ns2.ns1.svc.cluster.local.", dns.TypeAAAA), aa: true,
			an: []string{"ratings.ns2.ns1.svc.cluster.local. 30 IN CNAME ratings.ns2.svc.cluster.local.", "ratings.ns2.svc.cluster.local. 30 IN AAAA fd00::2:10"}},
		{name: "pod record AAAA of a v4 pod", req: query("10-244-1-9.ns1.pod.cluster.local.", dns.TypeAAAA), aa: true, ns: nodata},
		{name: "unknown cluster name AAAA", req: query("nope.ns1.svc.cluster.local.", dns.TypeAAAA), aa: true,
			rcode: dns.RcodeNameError, ns: nodata},
		// Other types are forwarded.
		{name: "external A", req: query("ext.example.org.", dns.TypeA), an: []string{"ext.example.org. 300 IN A 192.0.2.80"}},
		{name: "external TXT", req: query("ext.example.org.", dns.TypeTXT),
			ns: []string{"example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300"}},
	}
}

// aaaaFilterTable has a v4-only and a dual-stack Service, an ExternalName to an
// external name and a client of ns3.
func aaaaFilterTable(t *testing.T) *nametable.Table {
	return buildTable(t, []nametable.Host{
		{Name: "productpage.ns1.svc.cluster.local", Kubernetes: true, V4: []netip.Addr{netip.MustParseAddr("10.0.1.1")}},
		{Name: "ratings.ns2.svc.cluster.local", Kubernetes: true,
			V4: []netip.Addr{netip.MustParseAddr("10.0.2.10")}, V6: []netip.Addr{netip.MustParseAddr("fd00::2:10")}},
		{Name: "ext.ns1.svc.cluster.local", Kubernetes: true, Extra: &nametable.HostExtra{CNAME: "ext.example.org"}},
	}, map[string]string{"127.0.0.2": "ns3"})
}

func TestAAAAFilter(t *testing.T) {
	tb := aaaaFilterTable(t)
	for _, network := range []string{"udp", "tcp"} {
		ts := startServerTable(t, tb, func(c *Config) { c.Authoritative, c.PodRecords, c.FilterAAAA = true, true, true })
		runCasesOver(t, ts, network, aaaaFilterCases())
		for _, q := range ts.up.Queries() {
			if q.Type == dns.TypeAAAA {
				t.Errorf("%s: the upstream was asked AAAA %s; the filter answers it", network, q.Name)
			}
		}
		// Every filtered case above counts once.
		if got := metrictest.Value(t, ts.reg, "meshdns_dns_aaaa_filtered_total"); got != 6 {
			t.Errorf("%s: meshdns_dns_aaaa_filtered_total = %v, want 6", network, got)
		}
	}
}

// Off (the default), AAAA of external names is forwarded as before.
func TestAAAAFilterOff(t *testing.T) {
	tb := aaaaFilterTable(t)
	ts := startServerTable(t, tb, func(c *Config) { c.Authoritative = true })
	runCasesOver(t, ts, "udp", []tcase{
		{name: "external AAAA", req: query("ext.example.org.", dns.TypeAAAA),
			ns: []string{"example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300"}},
		{name: "external autopath AAAA", req: query("www.example.com.ns3.svc.cluster.local.", dns.TypeAAAA), client: "127.0.0.2",
			an: []string{"www.example.com.ns3.svc.cluster.local. 30 IN CNAME www.example.com."},
			ns: []string{"example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300"}},
	})
	if got := metrictest.Value(t, ts.reg, "meshdns_dns_aaaa_filtered_total"); got != 0 {
		t.Errorf("meshdns_dns_aaaa_filtered_total = %v, want 0 with the filter off", got)
	}
}
