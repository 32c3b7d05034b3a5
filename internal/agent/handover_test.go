package agent

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/handover"
)

// A listener handed to a successor keeps serving here until the drain, and
// still closes promptly then: sending its descriptor must not switch the open
// file description both processes share to blocking mode (os.File.Fd does),
// or this process's next accept blocks in the kernel and its Close waits for
// a connection that may never come (an old agent outlived its grace period).
func TestOfferLeavesSharedListenersNonBlocking(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") })
	a := newAdminServer("unix", sock, ok, nil, slog.New(slog.DiscardHandler))
	if err := a.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	get := func() {
		t.Helper()
		tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 2 * time.Second}).Get("http://agent/")
		if err != nil {
			t.Fatalf("GET: %v", err)
		}
		resp.Body.Close()
	}
	get()

	f, err := a.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	lock, err := os.CreateTemp(t.TempDir(), "lock")
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	dir := t.TempDir()
	hl, err := handover.Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer hl.Close()
	succ := make(chan error, 1)
	go func() { // the successor: takes the offer, says it serves
		in, err := handover.Request(t.Context(), dir)
		if err != nil {
			succ <- err
			return
		}
		in.CloseUnused()
		in.Lock.Release()
		succ <- in.Serving()
	}()
	c, err := hl.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := handover.ReadHello(c); err != nil {
		t.Fatal(err)
	}
	if _, err := handover.SendOffer(c, handover.Offer{State: &agentstate.State{}, Lock: lock, Local: f}); err != nil {
		t.Fatal(err)
	}
	if err := <-succ; err != nil {
		t.Fatalf("successor: %v", err)
	}

	get() // wakes the accept parked in the poller; it accepts on...
	get() // ...and accepts again
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close of a handed-over listener did not return in 5 s: its accept blocks in the kernel")
	}
}
