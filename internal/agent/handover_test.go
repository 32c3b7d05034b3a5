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

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
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
	here, there := seqpacketPair(t)
	go func() { // the successor: takes the offer, says it serves
		_, files, err := readMsg(there)
		for len(files) < 2 && err == nil {
			var more []*os.File
			_, more, err = readMsg(there)
			files = append(files, more...)
		}
		for _, f := range files {
			f.Close()
		}
		_ = writeMsg(there, handoverMsg{Op: "serving", PID: 2}, nil)
	}()
	if _, err := sendOffer(here, offer{state: &agentstate.State{}, lock: lock, local: f}); err != nil {
		t.Fatal(err)
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

func seqpacketPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "seqpacket")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
		t.Cleanup(func() { c.Close() })
	}
	return conns[0], conns[1]
}
