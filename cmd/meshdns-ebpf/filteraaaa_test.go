package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// `run --filter-aaaa external` (resolver only, unprivileged ports): AAAA of an external
// name is NODATA with an SOA and never reaches the upstream, its A still does, and
// /metrics counts the filtered query.
func TestRunFilterAAAAExternal(t *testing.T) {
	up := testenv.StartFakeDNS(t, nil, "127.0.0.1:0", map[string][]netip.Addr{
		"ext.example.org": {netip.MustParseAddr("192.0.2.80"), netip.MustParseAddr("2001:db8::80")}})
	listen := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	admin := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	var stderr testenv.SyncBuffer
	go func() {
		done <- run(ctx, []string{"run", "--filter-aaaa", "external", "--mode", "off",
			"--listen", listen, "--admin", admin, "--upstream", up.Addr, "--state-dir", t.TempDir()}, io.Discard, &stderr)
	}()
	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + admin + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if !testenv.WaitFor(20*time.Second, func() bool {
		select {
		case err := <-done:
			t.Fatalf("run exited: %v\n%s", err, stderr.String())
		default:
		}
		code, _ := get("/readyz")
		return code == http.StatusOK
	}) {
		t.Fatalf("not ready\n%s", stderr.String())
	}
	ask := func(qtype uint16) *dns.Msg {
		t.Helper()
		m := new(dns.Msg)
		m.SetQuestion("ext.example.org.", qtype)
		resp, _, err := (&dns.Client{Timeout: 2 * time.Second}).Exchange(m, listen)
		if err != nil {
			t.Fatalf("%s: %v", dns.TypeToString[qtype], err)
		}
		return resp
	}
	if r := ask(dns.TypeAAAA); r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 || len(r.Ns) != 1 || r.Ns[0].Header().Rrtype != dns.TypeSOA {
		t.Errorf("AAAA ext.example.org = %v; want NOERROR, no answer, an SOA", r)
	}
	if r := ask(dns.TypeA); r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
		t.Errorf("A ext.example.org = %v; want the upstream's address", r)
	}
	for _, q := range up.Queries() {
		if q.Type == dns.TypeAAAA {
			t.Errorf("the upstream was asked AAAA %s", q.Name)
		}
	}
	if _, body := get("/metrics"); !strings.Contains(body, "\nmeshdns_dns_aaaa_filtered_total 1\n") {
		t.Errorf("/metrics has no meshdns_dns_aaaa_filtered_total 1")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("stop: %v", err)
	}
}
