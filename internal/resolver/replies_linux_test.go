//go:build linux

package resolver

import (
	"context"
	"testing"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// One UDP reader reads the upstream replies between its batches: while the
// server runs, the forwarder's replies are claimed (by it) and forwarded
// queries are answered whole; once the server has drained, the reader has
// given them back, and the forwarder answers on its own.
func TestAUDPReaderReadsTheUpstreamReplies(t *testing.T) {
	ts := startServer(t, nil, nil)
	fwd := ts.s.fwd.(*upstream.Forwarder)
	if _, ok := fwd.ClaimReplies(); ok {
		t.Fatal("the replies are not claimed by a reader of the running server")
	}
	for _, name := range []string{"ext.example.org.", "case.example.org.", "nx.example.org."} {
		req := new(dns.Msg)
		req.SetQuestion(name, dns.TypeA)
		resp := exchange(t, "udp", ts.addr, req)
		want := dns.RcodeSuccess
		if name == "nx.example.org." {
			want = dns.RcodeNameError
		}
		if resp.Rcode != want || resp.Id != req.Id || len(resp.Question) != 1 || resp.Question[0].Name != name {
			t.Errorf("%s: got %s", name, resp)
		}
		if name == "ext.example.org." && (len(resp.Answer) != 1 || resp.Answer[0].String() != "ext.example.org.\t300\tIN\tA\t192.0.2.80") {
			t.Errorf("%s: answer %v, want ext.example.org. A 192.0.2.80", name, resp.Answer)
		}
	}

	if err := ts.s.Drain(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	fd, ok := fwd.ClaimReplies()
	if !ok || fd < 0 {
		t.Fatal("the drained server's reader did not give the replies back")
	}
	fwd.ReleaseReplies()
	if a, err := fwd.Forward(context.Background(), &upstream.Query{Name: "www.example.com.", Qtype: dns.TypeA, Qclass: dns.ClassINET}); err != nil || a.Answer != 2 {
		t.Errorf("forwarded after the drain: %d answers, err %v", a.Answer, err)
	}
}
