// Package filewatch calls a reload function when a file may have changed: on
// fsnotify events in its directory (debounced, so a burst of events, a truncate
// then a write or kubelet's ConfigMap renames, is one reload) and on every poll
// tick (fsnotify can be unavailable, and a directory created or replaced later
// is watched again from the next tick). The names file and the egress policy
// file are read this way.
package filewatch

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Debounce is how long a burst of events settles before the reload.
const Debounce = 50 * time.Millisecond

// Watch calls reload after changes to path until ctx ends, and at least every
// poll. reload runs on Watch's goroutine: calls do not overlap.
func Watch(ctx context.Context, path string, poll time.Duration, log *slog.Logger, reload func()) {
	dir := filepath.Dir(path)
	var events <-chan fsnotify.Event
	var errs <-chan error
	fw, err := fsnotify.NewWatcher()
	if err != nil {
		log.Warn("fsnotify unavailable, polling only", "err", err)
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
			log.Debug("cannot watch directory yet, polling", "dir", dir, "err", err)
			return
		}
		watching = true
	}
	addWatch()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if ev.Name == dir && ev.Op&(fsnotify.Remove|fsnotify.Rename) != 0 {
				watching = false
			}
			timer.Reset(Debounce)
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			log.Warn("fsnotify error, relying on polling", "err", err)
		case <-timer.C:
			reload()
		case <-tick.C:
			addWatch()
			reload()
		}
	}
}

// Fingerprint identifies a file's content cheaply, for telling whether it may
// have changed since it was last read: the symlink chain (kubelet swaps a
// ConfigMap volume's ..data) and the final file's identity, size, mtime and mode.
// Fingerprints are compared with ==.
type Fingerprint struct {
	exists      bool
	link, data  string
	dev, ino    uint64
	size, mtime int64
	mode        os.FileMode
}

// Stat returns path's fingerprint (a file that is not there has one too).
func Stat(path string) Fingerprint {
	var fp Fingerprint
	fp.link, _ = os.Readlink(path)
	fp.data, _ = os.Readlink(filepath.Join(filepath.Dir(path), "..data"))
	fi, err := os.Stat(path)
	if err != nil {
		return fp
	}
	fp.exists, fp.size, fp.mtime, fp.mode = true, fi.Size(), fi.ModTime().UnixNano(), fi.Mode()
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		fp.dev, fp.ino = uint64(st.Dev), st.Ino
	}
	return fp
}
