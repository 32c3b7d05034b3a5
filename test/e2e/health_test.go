package e2e

import (
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// /healthz fails when the resolver makes no progress while a query waits for
// it (a wedge), and only then. Under load it answers 200 for as long as the
// query path works. A query that wedges the query path (the --x-wedge-on
// fault: it, and every later query that reaches the cache, blocks its reader
// for good) makes it answer 503 within seconds, on the admin address and on the
// local socket, and `meshdns-ebpf probe live` then fails: the kubelet restarts
// the container.
func TestWedgedResolverFailsLiveness(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	n.start("ebpf", "--x-wedge-on", "wedge.test")
	ld := n.startLoad(pod, 500)
	defer ld.stop()
	n.waitRedirected(500)
	healthz := func() (int, string) { return n.httpGet("http://" + adminAddr + "/healthz") }
	for i := 0; i < 15; i++ {
		if code, body := healthz(); code != http.StatusOK {
			t.Fatalf("/healthz of a working resolver under load: %d %s", code, body)
		}
		time.Sleep(200 * time.Millisecond) // 3 s of looks: the pace of the checks, each of which must pass
	}

	_, _ = n.client(pod, 1000, "dig", "+time=1", "+tries=1", "wedge.test") // never answered
	wedged := time.Now()
	var code int
	var body string
	if !testenv.WaitFor(30*time.Second, func() bool {
		code, body = healthz()
		return code != http.StatusOK
	}) {
		t.Fatalf("/healthz still 200 %v after the query path wedged: %s", time.Since(wedged).Round(time.Millisecond), body)
	}
	t.Logf("/healthz %d %v after the wedge: %s", code, time.Since(wedged).Round(time.Millisecond), strings.TrimSpace(body))
	if code != http.StatusServiceUnavailable {
		t.Errorf("/healthz of a wedged resolver: %d, want 503", code)
	}
	if code, body := httpGetUnix(t, filepath.Join(n.stateDir, "admin.sock"), "/healthz"); code != http.StatusServiceUnavailable {
		t.Errorf("/healthz on the local socket: %d %s, want 503", code, body)
	}
	if out, err := n.cli("probe", "live", "--state-dir", n.stateDir); err == nil {
		t.Errorf("probe live passed for a wedged resolver:\n%s", out)
	}
}
