package nametable

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"
)

// PollInterval is how often the watcher stats the file as a fallback to
// fsnotify (which misses changes on some filesystems and bind mounts).
const PollInterval = time.Second

// debounce lets a burst of events (truncate then write, or kubelet's
// several renames) settle before the file is read.
const debounce = 50 * time.Millisecond

// Watcher loads a name table file and reloads it when it changes. A file
// that fails to load keeps the previous table serving; a missing or empty
// file is a valid empty table. Table() never blocks.
type Watcher struct {
	path   string
	opts   Options
	log    *slog.Logger
	cur    atomic.Pointer[Table]
	loads  atomic.Uint32
	mu     sync.Mutex // serialises reloads and guards lastErr/last
	last   fingerprint
	tried  bool
	lastOK bool

	lastErr atomic.Pointer[error]

	reloadErrors prometheus.Counter
	hosts        prometheus.Gauge
	lastSuccess  prometheus.Gauge
}

// NewWatcher creates a watcher for path. Metrics are registered with reg
// when it is not nil. It does not read the file: call Reload or Run.
func NewWatcher(path string, opts Options, reg prometheus.Registerer, log *slog.Logger) (*Watcher, error) {
	if path == "" {
		return nil, errors.New("name table path is empty")
	}
	if log == nil {
		log = slog.Default()
	}
	if _, err := Build(&File{}, opts); err != nil {
		return nil, err // bad options
	}
	w := &Watcher{
		path: path,
		opts: opts,
		log:  log.With("path", path),
		reloadErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "meshdns_nametable_reload_errors_total",
			Help: "Name table loads that failed; the previous table keeps serving.",
		}),
		hosts: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshdns_nametable_hosts",
			Help: "Hosts in the name table currently serving.",
		}),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "meshdns_nametable_last_reload_success_timestamp_seconds",
			Help: "Unix time of the last successful name table load.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{w.reloadErrors, w.hosts, w.lastSuccess} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register name table metrics: %w", err)
			}
		}
	}
	return w, nil
}

// Table returns the current table, or nil before the first successful load.
func (w *Watcher) Table() *Table { return w.cur.Load() }

// Path is the watched file.
func (w *Watcher) Path() string { return w.path }

// LastError is the error of the most recent load attempt, nil if it
// succeeded or none was made.
func (w *Watcher) LastError() error {
	if p := w.lastErr.Load(); p != nil {
		return *p
	}
	return nil
}

// fingerprint identifies the file content cheaply: the symlink chain
// (kubelet swaps ..data) and the final file's identity, size and mtime.
type fingerprint struct {
	exists      bool
	link, data  string
	dev, ino    uint64
	size, mtime int64
}

func (w *Watcher) stat() fingerprint {
	var fp fingerprint
	fp.link, _ = os.Readlink(w.path)
	fp.data, _ = os.Readlink(filepath.Join(filepath.Dir(w.path), "..data"))
	fi, err := os.Stat(w.path)
	if err != nil {
		return fp
	}
	fp.exists = true
	fp.size = fi.Size()
	fp.mtime = fi.ModTime().UnixNano()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		fp.dev, fp.ino = uint64(st.Dev), st.Ino
	}
	return fp
}

// Reload reads and builds the file now and swaps it in when it is valid.
// On error the previous table keeps serving, the error is logged and
// counted, and returned.
func (w *Watcher) Reload() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.reloadLocked(w.stat())
}

func (w *Watcher) reloadLocked(fp fingerprint) error {
	w.last = fp
	w.tried = true
	start := time.Now()
	f, err := ReadFile(w.path)
	if err == nil {
		opts := w.opts
		opts.Serial = w.loads.Load() + 1
		var t *Table
		t, err = Build(f, opts)
		if err != nil {
			err = fmt.Errorf("name table %s: %w", w.path, err)
		} else {
			w.cur.Store(t)
			w.loads.Add(1)
			w.lastErr.Store(nil)
			w.lastOK = true
			w.hosts.Set(float64(t.Len()))
			w.lastSuccess.Set(float64(time.Now().UnixNano()) / 1e9)
			w.log.Info("name table loaded", "hosts", t.Len(), "skipped", len(t.Skipped()),
				"exists", fp.exists, "duration", time.Since(start))
			if len(t.Skipped()) > 0 {
				w.log.Debug("hosts without addresses are forwarded", "hosts", t.Skipped())
			}
			return nil
		}
	}
	w.lastErr.Store(&err)
	w.lastOK = false
	w.reloadErrors.Inc()
	serving := "no table yet"
	if t := w.cur.Load(); t != nil {
		serving = fmt.Sprintf("previous table with %d hosts", t.Len())
	}
	w.log.Error("name table load failed, keeping "+serving, "err", err)
	return err
}

// check reloads when the file's fingerprint changed since the last attempt
// (a broken file is not re-read until it changes).
func (w *Watcher) check() {
	w.mu.Lock()
	defer w.mu.Unlock()
	fp := w.stat()
	if w.tried && fp == w.last {
		return
	}
	_ = w.reloadLocked(fp)
}

// Run loads the file (if not loaded yet) and then watches it until ctx is
// done: fsnotify on the file's directory, plus a stat/readlink poll every
// PollInterval as a fallback. It returns nil when ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	if w.cur.Load() == nil {
		w.check()
	}
	dir := filepath.Dir(w.path)
	var events <-chan fsnotify.Event
	var errs <-chan error
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		w.log.Warn("fsnotify unavailable, polling only", "err", err)
	} else {
		defer fw.Close()
		events, errs = fw.Events, fw.Errors
	}
	watching := false
	addWatch := func() {
		if fw == nil || watching {
			return
		}
		if err := fw.Add(dir); err != nil {
			w.log.Debug("cannot watch directory yet, polling", "dir", dir, "err", err)
			return
		}
		watching = true
	}
	addWatch()

	poll := time.NewTicker(PollInterval)
	defer poll.Stop()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if ev.Name == dir && ev.Op&(fsnotify.Remove|fsnotify.Rename) != 0 {
				watching = false
			}
			timer.Reset(debounce)
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			w.log.Warn("fsnotify error, relying on polling", "err", err)
		case <-timer.C:
			w.check()
		case <-poll.C:
			addWatch()
			w.check()
		}
	}
}
