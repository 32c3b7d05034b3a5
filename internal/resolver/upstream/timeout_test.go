package upstream

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

// An upstream slower than the first attempt's timeout is still answered
// (a retry keeps listening for the first query's reply), within the total budget, and
// it stays healthy.
func TestSlowUpstreamAnswered(t *testing.T) {
	for _, delay := range []time.Duration{800 * time.Millisecond, 1500 * time.Millisecond} {
		t.Run(delay.String(), func(t *testing.T) {
			up := startFake(t, answerA(300))
			up.SetDelay(delay)
			f, _, _ := testForwarder(t, NewConfig(up.addr)) // defaults: 500 ms first attempt, 3 s budget
			start := time.Now()
			resp, src := forward(t, f, query("slow.example.", dns.TypeA, 1))
			el := time.Since(start)
			t.Logf("%s upstream: answered in %s (source %s), %d queries sent", delay, el.Round(time.Millisecond), src, up.count())
			if src != SourceUpstream || len(resp.Answer) != 1 {
				t.Fatalf("source %v answer %v, want the upstream's A record", src, resp.Answer)
			}
			if el > delay+300*time.Millisecond {
				t.Errorf("answered after %s: the first query's reply (due at %s) was not taken", el, delay)
			}
			if h := f.Healthy()[0]; !h.Healthy || h.ConsecutiveFailures != 0 {
				t.Errorf("slow but answering upstream: %+v, want healthy with no failures counted", h)
			}
		})
	}
}

// One lost reply does not mark the upstream down; the retry is answered.
func TestOneLostReplyKeepsUpstreamHealthy(t *testing.T) {
	var n atomic.Int64
	answer := answerA(300)
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		if req.Question[0].Name != "." && n.Add(1) == 1 {
			return nil // the first reply is lost
		}
		return answer(proto, req)
	})
	f, reg, _ := testForwarder(t, NewConfig(up.addr))
	start := time.Now()
	resp, src := forward(t, f, query("lost.example.", dns.TypeA, 1))
	t.Logf("first reply lost: answered after %s by the retry (%d queries sent)", time.Since(start).Round(time.Millisecond), up.count())
	if src != SourceUpstream || len(resp.Answer) != 1 {
		t.Fatalf("source %v answer %v, want the retry's answer", src, resp.Answer)
	}
	h := f.Healthy()[0]
	if !h.Healthy || !h.Since.IsZero() {
		t.Fatalf("one lost reply marked the upstream down (even if only for a moment): %+v", h)
	}
	if got := metrictest.Value(t, reg, "meshdns_upstream_healthy", "upstream", up.addr.String()); got != 1 {
		t.Errorf("meshdns_upstream_healthy = %v, want 1", got)
	}
	// And the next query goes straight to it and is answered at once.
	start = time.Now()
	forward(t, f, query("next.example.", dns.TypeA, 2))
	if el := time.Since(start); el > 200*time.Millisecond {
		t.Errorf("next query took %s", el)
	}
}

// An attempt timeout follows the upstream's measured round-trip time.
func TestAttemptTimeoutFromRTT(t *testing.T) {
	up := startFake(t, answerA(1))
	cfg := NewConfig(up.addr)
	cfg.MinTTL = time.Second
	f, _, _ := testForwarder(t, cfg)
	for i := range 5 {
		forward(t, f, query("rtt"+string(rune('a'+i))+".example.", dns.TypeA, 1))
	}
	h := f.Healthy()[0]
	t.Logf("loopback upstream: smoothed RTT %s, attempt timeout %s", h.SmoothedRTT, h.AttemptTimeout)
	if h.SmoothedRTT <= 0 || h.AttemptTimeout != cfg.MinAttemptTimeout {
		t.Errorf("after 5 fast answers: %+v, want a measured RTT and the %s floor", h, cfg.MinAttemptTimeout)
	}
}

// A resolution whose attempts keep failing (a truncated answer whose TCP retry fails)
// leaves no socket or reader goroutine behind. (The overload test found each replaced
// attempt leaking one of each, with a 64 KiB buffer.)
func TestFailedAttemptsLeaveNothingBehind(t *testing.T) {
	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		m.Truncated = true // over UDP and TCP: the TCP retry fails every time
		return []*dns.Msg{m}
	})
	cfg := NewConfig(up.addr)
	cfg.Timeout = time.Second
	f, _, _ := testForwarder(t, cfg)
	before := runtime.NumGoroutine()
	for i := range 20 {
		if _, err := f.Forward(context.Background(), &Query{Name: fmt.Sprintf("tc%d.example.", i), Qtype: dns.TypeA, Qclass: dns.ClassINET}); err == nil {
			t.Fatal("want an error")
		}
	}
	waitFor(t, 2*time.Second, "reader goroutines to end", func() bool { return runtime.NumGoroutine() <= before+2 })
}
