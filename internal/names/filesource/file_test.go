package filesource

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

var quiet = slog.New(slog.DiscardHandler)

func hostIP(tb *nametable.Table, name string) string {
	if tb == nil {
		return "<nil table>"
	}
	n := tb.Lookup(name)
	if n == nil || len(n.Host.V4) == 0 {
		return ""
	}
	return n.Host.V4[0].String()
}

type env struct {
	store *names.Store
	reg   *prometheus.Registry
	file  *File
}

// start runs a store with the file source for path (Check first when
// check is set, as the agent does).
func start(t *testing.T, path string, check bool) *env {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := names.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	st, err := names.New(names.Config{Metrics: m, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	f, err := NewFile(path, Options{Domain: st.Domain(), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if check {
		if err := f.Check(); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Add(f, names.SourceOptions{Priority: names.PriorityFile}); err != nil {
		t.Fatal(err)
	}
	if err := st.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return &env{st, reg, f}
}

func (e *env) errors(t *testing.T) float64 {
	return metrictest.Value(t, e.reg, "meshdns_names_source_errors_total", "source", "file")
}

func waitFor(t *testing.T, e *env, what string, cond func(*nametable.Table) bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if cond(e.store.Table()) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("not within 3s: %s", what)
}

func waitErrors(t *testing.T, e *env, want float64) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for e.errors(t) < want && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := e.errors(t); got != want {
		t.Fatalf("file source errors = %v, want %v", got, want)
	}
}

func TestFileConfigMapSwap(t *testing.T) {
	dir := t.TempDir()
	const file = "name-table.yaml"
	testenv.KubeletWrite(t, dir, file, "table:\n  a.example.com:\n    ips: [192.0.2.1]\n", 1)
	e := start(t, filepath.Join(dir, file), true)
	waitFor(t, e, "initial table", func(tb *nametable.Table) bool { return hostIP(tb, "a.example.com.") == "192.0.2.1" })

	testenv.KubeletWrite(t, dir, file, "table:\n  a.example.com:\n    ips: [192.0.2.2]\n", 2)
	waitFor(t, e, "new address after ..data swap", func(tb *nametable.Table) bool { return hostIP(tb, "a.example.com.") == "192.0.2.2" })

	// A bad file keeps the old table, counts, and says why.
	testenv.KubeletWrite(t, dir, file, "table:\n  a.example.com:\n    ips: [not-an-ip]\n", 3)
	waitErrors(t, e, 1)
	if got := hostIP(e.store.Table(), "a.example.com."); got != "192.0.2.2" {
		t.Fatalf("after bad file: a = %q, want the previous 192.0.2.2", got)
	}
	if st := e.store.Status()[0]; !strings.Contains(st.LastError, "ips[0]") || !strings.Contains(st.LastError, file) || st.FailingSince.IsZero() {
		t.Fatalf("status after a bad file = %+v, want the file and field, failing", st)
	}
	if got := metrictest.Value(t, e.reg, "meshdns_nametable_hosts"); got != 1 {
		t.Fatalf("hosts gauge = %v", got)
	}

	// Fixed again, then an empty file is a valid empty table.
	testenv.KubeletWrite(t, dir, file, "table:\n  b.example.com:\n    ips: [192.0.2.3]\n", 4)
	waitFor(t, e, "b after fix", func(tb *nametable.Table) bool { return hostIP(tb, "b.example.com.") == "192.0.2.3" })
	if st := e.store.Status()[0]; !st.FailingSince.IsZero() {
		t.Fatalf("still failing after a good load: %+v", st)
	}
	testenv.KubeletWrite(t, dir, file, "", 5)
	waitFor(t, e, "empty table", func(tb *nametable.Table) bool { return tb != nil && tb.Len() == 0 })
}

func TestFileAtomicRenameAndDelete(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "table.json")
	if err := os.WriteFile(path, []byte(`{"table": {"c.example.com": {"ips": ["192.0.2.4"]}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	e := start(t, path, false)
	waitFor(t, e, "first load", func(tb *nametable.Table) bool { return hostIP(tb, "c.example.com.") == "192.0.2.4" })
	// Atomic replace (write temp + rename), as a careful writer does.
	replaceFile(t, path, `{"table": {"c.example.com": {"ips": ["192.0.2.5"]}}}`)
	waitFor(t, e, "c after rename", func(tb *nametable.Table) bool { return hostIP(tb, "c.example.com.") == "192.0.2.5" })

	// A deleted file keeps the last good table and is an error, not an
	// empty table.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	waitErrors(t, e, 1)
	if got := hostIP(e.store.Table(), "c.example.com."); got != "192.0.2.5" {
		t.Fatalf("after delete: c = %q, want the last good 192.0.2.5", got)
	}
	if st := e.store.Status()[0]; !strings.Contains(st.LastError, "no such file") {
		t.Fatalf("status after delete = %+v", st)
	}
}

// The first load is checked before the agent starts: a bad file, a missing
// file, a FIFO, a device or an oversized file is an error at once, never a
// hang.
func TestFileCheckErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("table: [\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(big, []byte("table: {}\n"+strings.Repeat("#", 2000)+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path string
		max  int64
		want string
	}{
		{bad, 0, "line"},
		{filepath.Join(dir, "missing.yaml"), 0, "no such file"},
		{fifo, 0, "not a regular file"},
		{"/dev/zero", 0, "not a regular file"},
		{dir, 0, "not a regular file"},
		{big, 1024, "more than the limit of 1024"},
	}
	for _, tt := range tests {
		t.Run(filepath.Base(tt.path), func(t *testing.T) {
			f, err := NewFile(tt.path, Options{MaxSize: tt.max, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- f.Check() }()
			select {
			case err = <-done:
			case <-time.After(5 * time.Second):
				t.Fatalf("Check(%s) hangs", tt.path)
			}
			if err == nil || !strings.Contains(err.Error(), tt.path) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Check = %v, want an error naming %s and %q", err, tt.path, tt.want)
			}
		})
	}
}

// A FIFO swapped in while running fails that reload without blocking
// anything: the last table keeps serving and other sources still update.
func TestFileBecomesFIFO(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "t.yaml")
	if err := os.WriteFile(path, []byte("table:\n  d.example.com:\n    ips: [192.0.2.6]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e := start(t, path, true)
	waitFor(t, e, "first load", func(tb *nametable.Table) bool { return hostIP(tb, "d.example.com.") == "192.0.2.6" })
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
	waitErrors(t, e, 1)
	other, err := NewStatic("other", []byte("table:\n  e.example.com:\n    ips: [192.0.2.7]\n"), "")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.store.Add(other, names.SourceOptions{Priority: 1}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, e, "another source's host while the file is a FIFO", func(tb *nametable.Table) bool {
		return hostIP(tb, "e.example.com.") == "192.0.2.7" && hostIP(tb, "d.example.com.") == "192.0.2.6"
	})
}

// replaceFile replaces path with content atomically (write a temporary file
// beside it, rename it over path), as a careful writer does.
func replaceFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// applySink records each Apply's keys.
type applySink struct {
	names.Sink
	mu      sync.Mutex
	applies [][]string
}

func (a *applySink) Apply(c *nametable.Change) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.applies = append(a.applies, c.Keys())
	return nil
}

func (a *applySink) Synced()      {}
func (a *applySink) Failed(error) {}

func (a *applySink) last() ([]string, int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.applies) == 0 {
		return nil, 0
	}
	return a.applies[len(a.applies)-1], len(a.applies)
}

// A reload delivers, in one change, only the entries that changed: an
// entry rewritten with the same content, and the reload of an unchanged
// file, deliver nothing.
func TestReloadDeliversOnlyChanges(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "t.json")
	var b strings.Builder
	b.WriteString(`{"table": {`)
	for i := range 1000 {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, "\n\"s%d.example.com\": {\"ips\": [\"10.1.%d.%d\"]}", i, i/256, i%256)
	}
	v1 := b.String() + "}}"
	replaceFile(t, path, v1)
	f, err := NewFile(path, Options{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	sink := &applySink{}
	f.load(sink, true)
	if keys, n := sink.last(); n != 1 || len(keys) != 1000 {
		t.Fatalf("first load: %d applies, the last of %d keys; want one of 1000", n, len(keys))
	}
	// One entry changed, one gone, one new; the rest reindented.
	v2 := strings.ReplaceAll(v1, "\n", "\n  ")
	v2 = strings.Replace(v2, `"10.1.0.7"`, `"10.9.0.7"`, 1)
	v2 = strings.Replace(v2, `"s8.example.com": {"ips": ["10.1.0.8"]},`, ``, 1)
	v2 = strings.Replace(v2, `{"table": {`, `{"table": {"new.example.com": {"ips": ["10.2.0.1"]},`, 1)
	replaceFile(t, path, v2)
	f.load(sink, false)
	keys, n := sink.last()
	if want := []string{"-s8.example.com", "new.example.com", "s7.example.com"}; n != 2 || !slices.Equal(keys, want) {
		t.Fatalf("reload: %d applies, the last %v; want a second one of %v", n, keys, want)
	}
	replaceFile(t, path, v2) // the same content, a new file: read, nothing to deliver
	f.load(sink, false)
	if _, n := sink.last(); n != 2 {
		t.Errorf("a reload of the same content delivered something (%d applies)", n)
	}
}

// The file is read through a limit: a file that has grown past it since it
// was opened is refused, one exactly at it is read whole.
func TestLimitReader(t *testing.T) {
	for _, tt := range []struct {
		size int
		over bool
	}{{99, false}, {100, false}, {101, true}, {5000, true}} {
		l := &limitReader{r: strings.NewReader(strings.Repeat("x", tt.size)), left: 100}
		data, err := io.ReadAll(l)
		if err != nil {
			t.Fatal(err)
		}
		if want := min(tt.size, 100); len(data) != want || l.over != tt.over {
			t.Errorf("%d bytes: read %d, over %v; want %d, %v", tt.size, len(data), l.over, want, tt.over)
		}
	}
}

// A reload that rewrites most of the file tells Options.LargeChange while
// the file is read (before the sink gets the change) and once it was
// delivered; a reload that changes a few entries tells nothing.
func TestLargeReloadIsToldBeforeItIsRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "t.json")
	file := func(gen int, changed func(i int) bool) string {
		var b strings.Builder
		b.WriteString(`{"table": {`)
		for i := range 2000 {
			if i > 0 {
				b.WriteString(",")
			}
			g := 1
			if changed(i) {
				g = gen
			}
			fmt.Fprintf(&b, "\n\"s%d.example.com\": {\"ips\": [\"10.%d.%d.%d\"]}", i, g, i/256, i%256)
		}
		return b.String() + "}}"
	}
	var events []string
	sink := &applySink{}
	f, err := NewFile(path, Options{Logger: quiet, LargeChange: func(begins bool) {
		_, applies := sink.last()
		events = append(events, fmt.Sprintf("%v after %d applies", begins, applies))
	}})
	if err != nil {
		t.Fatal(err)
	}
	replaceFile(t, path, file(1, func(int) bool { return false }))
	f.load(sink, true)
	replaceFile(t, path, file(2, func(i int) bool { return i%100 == 0 })) // 1%
	f.load(sink, false)
	if len(events) != 0 {
		t.Fatalf("events %v for a first load and a reload of 1%%, want none", events)
	}
	replaceFile(t, path, file(3, func(int) bool { return true }))
	f.load(sink, false)
	if want := []string{"true after 2 applies", "false after 3 applies"}; !slices.Equal(events, want) {
		t.Errorf("events %v for a rewrite of every entry, want %v", events, want)
	}
}
