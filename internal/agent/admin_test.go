package agent

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

type readyFunc func() error

func (f readyFunc) Ready() error { return f() }
func (readyFunc) Live() error    { return nil }

// The admin server closes connections that send nothing (read timeouts), so a
// flood of idle connections does not keep /healthz and /metrics from answering;
// /readyz follows readiness.
func TestAdminServer(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newBuildInfo())
	ready := errors.New("name table not loaded yet")
	a := newAdminServer("tcp", "127.0.0.1:0", adminMux(reg, readyFunc(func() error { return ready }), nil), nil, slog.New(slog.DiscardHandler))
	a.hs.ReadHeaderTimeout = 300 * time.Millisecond // the production value is adminReadHeaderTimeout
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	base := "http://" + a.ln.Addr().String()
	get := func(path string) (int, string) {
		t.Helper()
		c := http.Client{Timeout: 2 * time.Second}
		resp, err := c.Get(base + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "name table") {
		t.Errorf("/readyz while not ready: %d %q", code, body)
	}
	ready = nil
	if code, _ := get("/readyz"); code != http.StatusOK {
		t.Errorf("/readyz when ready: %d", code)
	}

	// Idle connections that never send a request are closed by the server.
	var idle []net.Conn
	for i := 0; i < 200; i++ {
		c, err := net.Dial("tcp", a.ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		idle = append(idle, c)
	}
	if code, body := get("/metrics"); code != http.StatusOK || !strings.Contains(body, "meshdns_build_info") {
		t.Errorf("/metrics with 200 idle connections open: %d", code)
	}
	_ = idle[0].SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	if _, err := idle[0].Read(make([]byte, 1)); err == nil {
		t.Errorf("an idle connection got data")
	} else if el := time.Since(start); el > 3*time.Second {
		t.Errorf("an idle connection stayed open %v: no read timeout", el)
	}
	for _, v := range []time.Duration{a.hs.ReadTimeout, a.hs.WriteTimeout, a.hs.IdleTimeout} {
		if v == 0 {
			t.Errorf("admin server timeouts: read %v write %v idle %v, want all set", a.hs.ReadTimeout, a.hs.WriteTimeout, a.hs.IdleTimeout)
		}
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz: %d", code)
	}
}

// Only an admin address reachable from this host alone may serve the debug
// endpoints.
func TestLoopbackAdmin(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:9153":      true,
		"127.0.0.53:9153":     true,
		"[::1]:9153":          true,
		"localhost:9153":      true,
		"10.0.0.7:9153":       false,
		"[fd00::7]:9153":      false,
		"0.0.0.0:9153":        false,
		":9153":               false,
		"[::]:9153":           false,
		"node.example.com:80": false,
	} {
		if got := loopbackAdmin(addr); got != want {
			t.Errorf("loopbackAdmin(%q) = %v, want %v", addr, got, want)
		}
	}
}
