package nametable

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
)

// kubeletWrite mimics the ConfigMap volume update: a new timestamped
// directory, a temporary symlink to it, renamed over ..data atomically.
func kubeletWrite(t *testing.T, dir, file, content string, gen int) {
	t.Helper()
	ts := filepath.Join(dir, fmt.Sprintf("..2026_01_01_00_00_%02d.%d", gen, gen))
	if err := os.Mkdir(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ts, file), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, file)
	if _, err := os.Lstat(link); os.IsNotExist(err) {
		if err := os.Symlink(filepath.Join("..data", file), link); err != nil {
			t.Fatal(err)
		}
	}
}

func hostIP(tb *Table, name string) string {
	if tb == nil {
		return "<nil table>"
	}
	n := tb.Lookup(name)
	if n == nil || len(n.Host.V4) == 0 {
		return ""
	}
	return n.Host.V4[0].String()
}

func waitFor(t *testing.T, w *Watcher, what string, cond func(*Table) bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		if cond(w.Table()) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("not within 2s: %s", what)
}

func TestWatcherConfigMapSwap(t *testing.T) {
	for _, mode := range []string{"fsnotify+poll", "poll only (no events)"} {
		t.Run(mode, func(t *testing.T) {
			dir := t.TempDir()
			const file = "name-table.yaml"
			kubeletWrite(t, dir, file, "table:\n  a.example.com:\n    ips: [192.0.2.1]\n", 1)
			reg := prometheus.NewRegistry()
			w, err := NewWatcher(filepath.Join(dir, file), Options{}, reg, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Reload(); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			if mode == "fsnotify+poll" {
				go func() { done <- w.Run(ctx) }()
			} else {
				// Drive only the poll: what happens when fsnotify sees nothing.
				go func() {
					tk := time.NewTicker(PollInterval)
					defer tk.Stop()
					for {
						select {
						case <-ctx.Done():
							done <- nil
							return
						case <-tk.C:
							w.check()
						}
					}
				}()
			}
			t.Cleanup(func() { cancel(); <-done })

			if got := hostIP(w.Table(), "a.example.com."); got != "192.0.2.1" {
				t.Fatalf("initial: a = %q", got)
			}
			kubeletWrite(t, dir, file, "table:\n  a.example.com:\n    ips: [192.0.2.2]\n", 2)
			waitFor(t, w, "new address after ..data swap", func(tb *Table) bool { return hostIP(tb, "a.example.com.") == "192.0.2.2" })

			// A bad file keeps the old table, counts, and says why.
			before := metrictest.Value(t, reg, "meshdns_nametable_reload_errors_total")
			kubeletWrite(t, dir, file, "table:\n  a.example.com:\n    ips: [not-an-ip]\n", 3)
			deadline := time.Now().Add(2 * time.Second)
			for metrictest.Value(t, reg, "meshdns_nametable_reload_errors_total") == before && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if got := metrictest.Value(t, reg, "meshdns_nametable_reload_errors_total"); got != before+1 {
				t.Fatalf("reload errors = %v, want %v", got, before+1)
			}
			if got := hostIP(w.Table(), "a.example.com."); got != "192.0.2.2" {
				t.Fatalf("after bad file: a = %q, want the previous 192.0.2.2", got)
			}
			if err := w.LastError(); err == nil || !strings.Contains(err.Error(), "ips[0]") || !strings.Contains(err.Error(), file) {
				t.Fatalf("LastError = %v, want the file and field", err)
			}
			if got := metrictest.Value(t, reg, "meshdns_nametable_hosts"); got != 1 {
				t.Fatalf("hosts gauge = %v", got)
			}

			// Fixed again, then an empty file is a valid empty table.
			kubeletWrite(t, dir, file, "table:\n  b.example.com:\n    ips: [192.0.2.3]\n", 4)
			waitFor(t, w, "b after fix", func(tb *Table) bool { return hostIP(tb, "b.example.com.") == "192.0.2.3" })
			if w.LastError() != nil {
				t.Fatalf("LastError after a good load: %v", w.LastError())
			}
			kubeletWrite(t, dir, file, "", 5)
			waitFor(t, w, "empty table", func(tb *Table) bool { return tb != nil && tb.Len() == 0 })
			if ts := metrictest.Value(t, reg, "meshdns_nametable_last_reload_success_timestamp_seconds"); ts < float64(time.Now().Add(-time.Minute).Unix()) {
				t.Fatalf("last success timestamp %v", ts)
			}
		})
	}
}

func TestWatcherPlainFileAndMissing(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "table.json")
	w, err := NewWatcher(path, Options{}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	waitFor(t, w, "missing file is an empty table", func(tb *Table) bool { return tb != nil && tb.Len() == 0 })
	// Atomic replace (write temp + rename), as a careful writer does.
	tmp := filepath.Join(dir, ".tmp")
	if err := os.WriteFile(tmp, []byte(`{"table": {"c.example.com": {"ips": ["192.0.2.4"]}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	waitFor(t, w, "c after rename", func(tb *Table) bool { return hostIP(tb, "c.example.com.") == "192.0.2.4" })
}

func TestWatcherFirstLoadBad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "t.yaml")
	if err := os.WriteFile(path, []byte("table: [\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	w, err := NewWatcher(path, Options{}, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	err = w.Reload()
	if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "line") {
		t.Fatalf("Reload = %v, want an error naming file and line", err)
	}
	if w.Table() != nil {
		t.Fatalf("a table is served after a failed first load")
	}
}
