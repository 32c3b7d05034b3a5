package dnsfake

import (
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// Each answer MixProber takes is timed twice: as the client saw it, and (on
// Linux, by the kernel's receive timestamp) at its arrival in the socket, which
// comes after the send and no later than the client saw it.
func TestMixProberTimesEachAnswersArrival(t *testing.T) {
	const delay = 2 * time.Millisecond
	up, err := Listen(Config{Addr: "127.0.0.1:0", NoRecord: true, Respond: func(_ string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		return []*dns.Msg{m}
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	up.SetDelay(delay)
	stop := make(chan struct{})
	time.AfterFunc(200*time.Millisecond, func() { close(stop) })
	p, err := MixProber(up.Addr.String(), netip.Addr{}, []string{"a.example.", "b.example."}, time.Second, time.Millisecond, stop)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Latencies) < 10 || p.Lost+p.Failed > 0 {
		t.Fatalf("%d answered, %d lost, %d failed: want at least 10 answered and none lost or failed", len(p.Latencies), p.Lost, p.Failed)
	}
	if runtime.GOOS != "linux" {
		if len(p.Arrivals) != 0 {
			t.Fatalf("%d arrival times off Linux, want none", len(p.Arrivals))
		}
		return
	}
	if len(p.Arrivals) != len(p.Latencies) {
		t.Fatalf("%d arrival times for %d answers", len(p.Arrivals), len(p.Latencies))
	}
	for i, a := range p.Arrivals {
		if a < delay || a > p.Latencies[i] {
			t.Errorf("answer %d: arrived after %s, seen after %s; want between the upstream's delay (%s) and when it was seen", i, a, p.Latencies[i], delay)
		}
	}
	for n, bp := range p.ByName {
		if len(bp.Arrivals) != len(bp.Latencies) {
			t.Errorf("%s: %d arrival times for %d answers", n, len(bp.Arrivals), len(bp.Latencies))
		}
	}
}
