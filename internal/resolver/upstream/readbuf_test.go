package upstream

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/miekg/dns"
)

func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// A query waiting for the upstream holds a few KiB, not a buffer for the largest
// DNS message: 128 of them (one workload's in-flight cap) held 8 MiB while an
// upstream that drops queries kept them waiting.
func TestWaitingUpstreamQueriesHoldLittleMemory(t *testing.T) {
	up := startFake(t, silent)
	cfg := NewConfig(up.addr)
	cfg.Timeout, cfg.AttemptTimeout = 20*time.Second, 10*time.Second // nothing is retried meanwhile
	f, _, _ := testForwarder(t, cfg)
	before := liveHeap()
	const n = 128
	for i := range n {
		f.ForwardAsync(toQuery(query(fmt.Sprintf("w%d.example.", i), dns.TypeA, uint16(i))), func(Answer, error) {})
	}
	waitFor(t, 10*time.Second, "every query sent upstream", func() bool { return up.count() == n })
	after := liveHeap()
	held := after - min(before, after)
	t.Logf("%d queries waiting hold %d KiB of heap, %d bytes each", n, held>>10, held/n)
	if per := held / n; per > 16<<10 {
		t.Errorf("each waiting query holds %d bytes of heap, want at most 16 KiB", per)
	}
	f.Close() // ends the resolutions
}

// A UDP reply larger than the read buffer (an upstream that ignores the EDNS size
// advertised) is taken as truncated: the query is retried over TCP and the whole
// answer delivered.
func TestOversizedUDPReplyRetriedOverTCP(t *testing.T) {
	const n = 400 // ~6.4 KB of A records over UDP, whatever the advertised size
	up := startFake(t, func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		m.Answer = aRecords(req.Question[0].Name, n)
		return []*dns.Msg{m}
	})
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	resp, src := forward(t, f, query("huge.example.", dns.TypeA, 5))
	if src != SourceUpstream || len(resp.Answer) != n {
		t.Fatalf("source %q with %d answers, want upstream with %d", src, len(resp.Answer), n)
	}
	qs := up.queries()
	if len(qs) != 2 || qs[0].Proto != "udp" || qs[1].Proto != "tcp" {
		t.Fatalf("upstream saw %+v, want udp then tcp", qs)
	}
}
