package resolver

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// threadsAtNice counts the process's threads whose nice value is nice; with
// skipMain, the main thread does not count.
func threadsAtNice(t *testing.T, nice int, skipMain bool) int {
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
		// (state); nice is field 19.
		f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
		if v, err := strconv.Atoi(f[19-3]); err == nil && v == nice {
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
