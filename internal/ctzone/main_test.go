package ctzone

import (
	"fmt"
	"log/slog"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone/ctzonetest"
)

func netnsIno(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// TestMain dispatches the workload helpers and installs the guard that makes
// every iptables command and conntrack socket of this package fail when it would
// act in the test process's own network namespace (the host's): tests program
// only namespaces they created.
func TestMain(m *testing.M) {
	ctzonetest.MaybeRunHelper()
	host, err := netnsIno("/proc/self/ns/net")
	if err != nil {
		fmt.Fprintln(os.Stderr, "read own netns:", err)
		os.Exit(1)
	}
	guard = func() error {
		cur, err := netnsIno(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()))
		if err != nil {
			return fmt.Errorf("test guard: %w", err)
		}
		if cur == host {
			return fmt.Errorf("test guard: refusing to touch the host network namespace")
		}
		return nil
	}
	os.Exit(m.Run())
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
