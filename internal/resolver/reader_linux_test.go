package resolver

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// threadsAtNice counts the process's threads whose nice value is nice; with
// skipMain, the main thread does not count.
func threadsAtNice(t *testing.T, nice int, skipMain bool) int {
	return threadsWhere(t, func(_, n int) bool { return n == nice }, skipMain)
}

// realtime matches a thread at real-time priority (SCHED_FIFO), for threadsWhere.
func realtime(policy, _ int) bool { return policy == unix.SCHED_FIFO }

// threadsWhere counts the process's threads whose scheduling policy and nice
// value match; with skipMain, the main thread does not count.
func threadsWhere(t *testing.T, match func(policy, nice int) bool, skipMain bool) int {
	t.Helper()
	stats, err := filepath.Glob("/proc/self/task/*/stat")
	if err != nil {
		t.Fatal(err)
	}
	main := filepath.Join("/proc/self/task", strconv.Itoa(os.Getpid()), "stat")
	n := 0
	for _, path := range stats {
		if skipMain && path == main {
			continue
		}
		b, err := os.ReadFile(path)
		if err != nil {
			continue // the thread ended
		}
		// Fields after the command's closing parenthesis start at field 3
		// (state); nice is field 19, the policy field 41.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		nice, err1 := strconv.Atoi(f[19-3])
		policy, err2 := strconv.Atoi(f[41-3])
		if err1 == nil && err2 == nil && match(policy, nice) {
			n++
		}
	}
	return n
}

// With Config.ReaderNice every UDP reader answers from a thread of its own at
// that nice value, and the threads end with the readers: no other goroutine of
// the process ever runs at the readers' priority. (A reader that ran on the
// main thread leaves it parked for good: the runtime never ends the main
// thread, and a parked thread runs nothing.)
func TestReaderThreadsRunAtReaderNice(t *testing.T) {
	testenv.RequirePrivileged(t)
	const nice = -3
	if n := threadsAtNice(t, nice, false); n != 0 {
		t.Fatalf("%d threads at nice %d before the server started", n, nice)
	}
	ts := startServer(t, testFile(), func(c *Config) { c.ReaderNice = nice })
	readers := len(ts.s.udp)
	for range 2 * readers {
		if resp := exchange(t, "udp", ts.addr, query("productpage.ns1.svc.cluster.local.", dns.TypeA)()); len(resp.Answer) != 1 {
			t.Fatalf("answer: %v", resp)
		}
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return threadsAtNice(t, nice, false) == readers },
		"threads at nice %d: want one per UDP reader (%d)", nice, readers)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ts.s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return threadsAtNice(t, nice, true) == 0 },
		"threads at nice %d after the readers stopped: want none", nice)
}

// With Config.ReaderRealtime every UDP reader answers from a thread of its own
// at that real-time priority, and no other thread of the process runs at it,
// before or after the readers.
func TestReaderThreadsRunAtRealtimePriority(t *testing.T) {
	testenv.RequirePrivileged(t)
	if n := threadsWhere(t, realtime, false); n != 0 {
		t.Fatalf("%d threads at real-time priority before the server started", n)
	}
	ts := startServer(t, testFile(), func(c *Config) { c.ReaderNice, c.ReaderRealtime = -3, 1 })
	readers := len(ts.s.udp)
	for range 2 * readers {
		if resp := exchange(t, "udp", ts.addr, query("productpage.ns1.svc.cluster.local.", dns.TypeA)()); len(resp.Answer) != 1 {
			t.Fatalf("answer: %v", resp)
		}
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return threadsWhere(t, realtime, false) == readers },
		"threads at real-time priority: want one per UDP reader (%d)", readers)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ts.s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return threadsWhere(t, realtime, true) == 0 },
		"threads at real-time priority after the readers stopped: want none")
}

// A reader flooded past its real-time share of a CPU runs at its nice value for
// the rest of the window (counted), so a flood never holds a CPU at real-time
// priority; once the flood is over it is back at real-time priority.
func TestAFloodedReaderRunsAtItsNiceUntilTheFloodEnds(t *testing.T) {
	testenv.RequirePrivileged(t)
	const nice = -3
	ts := startServer(t, testFile(), func(c *Config) {
		c.ReaderNice, c.ReaderRealtime = nice, 1
		c.ReaderRealtimeShare = 0.01 // 100 µs of every 10 ms
	})
	readers := len(ts.s.udp)
	flood, err := dnsfake.FloodUDP(netip.MustParseAddrPort(ts.addr), 9, 4, 5000,
		func(c, i int) string { return "productpage.ns1.svc.cluster.local." }, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got := metrictest.Value(t, ts.reg, "meshdns_dns_reader_realtime_overruns_total"); got < 1 {
		t.Errorf("overruns of the real-time share after a flood of 20,000 queries (%v answered): %v, want at least 1", flood.Rcodes, got)
	}
	testenv.Eventually(t, 5*time.Second, func() bool {
		exchange(t, "udp", ts.addr, query("productpage.ns1.svc.cluster.local.", dns.TypeA)())
		return threadsWhere(t, realtime, false) == readers
	}, "threads at real-time priority after the flood: want one per UDP reader (%d)", readers)
}
