package e2e

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// nodeAdmin is an admin address on a node address every pod reaches (the
// node's side of the first pod's veth), as --admin=$(NODE_IP):9153 is in the
// DaemonSet.
const nodeAdmin = "169.254.100.1:9153"

// The admin listener on a node address serves /metrics, /healthz and /readyz
// and nothing else: any pod can reach it. The debug endpoints (the name table
// with each host's visibility, the node's pods, the name sources) are served
// only on the agent's local socket in its state directory (0600), which the CLI
// uses; that socket is handed over with the rest in an overlapped upgrade, so
// the CLI works before and after one.
func TestDebugStaysLocal(t *testing.T) {
	n := newNode(t)
	n.start("ebpf", "--admin", nodeAdmin)
	check := func(when string) {
		t.Helper()
		for _, p := range []string{"/metrics", "/healthz", "/readyz"} {
			if code, body := httpGetIn(t, n.pod, "http://"+nodeAdmin+p); code != http.StatusOK {
				t.Errorf("%s: %s from a pod: %d %s", when, p, code, body)
			}
		}
		for _, p := range []string{"/debug/table", "/debug/ndsz", "/debug/sources", "/debug/pods", "/debug/",
			"/debug/tap", "/debug/pprof/", "/", "/anything"} {
			if code, body := httpGetIn(t, n.pod, "http://"+nodeAdmin+p); code != http.StatusNotFound {
				t.Errorf("%s: %s from a pod: %d, want 404 (only /metrics, /healthz and /readyz are served there):\n%.300s", when, p, code, body)
			}
		}
		sock := filepath.Join(n.stateDir, "admin.sock")
		fi, err := os.Stat(sock)
		if err != nil {
			t.Fatalf("%s: the agent's local socket: %v", when, err)
		}
		if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: %s is %v, want a socket only its owner (root) may use", when, sock, fi.Mode())
		}
		if code, body := httpGetUnix(t, sock, "/debug/table"); code != http.StatusOK || !strings.Contains(body, meshName) {
			t.Errorf("%s: /debug/table on the local socket: %d %.300s", when, code, body)
		}
		out, err := n.cli("table", "--state-dir", n.stateDir)
		if err != nil || !strings.Contains(out, meshName) {
			t.Errorf("%s: table through the local socket: %v\n%s", when, err, out)
		}
		out, err = n.cli("status", "--state-dir", n.stateDir, "--bpffs", n.bpffs)
		if err != nil || !strings.Contains(out, "SOURCE") || !strings.Contains(out, "ready") {
			t.Errorf("%s: status (readiness and name sources through the local socket): %v\n%s", when, err, out)
		}
	}
	check("first agent")
	n.upgrade("ebpf", "--admin", nodeAdmin)
	check("after an overlapped upgrade")
}

// httpGetIn fetches a URL from inside ns.
func httpGetIn(t *testing.T, ns *testenv.Netns, url string) (int, string) {
	t.Helper()
	return httpGetWith(t, url, func(ctx context.Context, network, addr string) (net.Conn, error) {
		var c net.Conn
		err := ns.Do(func() (err error) {
			c, err = (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	})
}

// httpGetUnix fetches path from the HTTP server on the unix socket sock.
func httpGetUnix(t *testing.T, sock, path string) (int, string) {
	t.Helper()
	return httpGetWith(t, "http://agent"+path, func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, "unix", sock)
	})
}

func httpGetWith(t *testing.T, url string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) (int, string) {
	t.Helper()
	tr := &http.Transport{DialContext: dial}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
