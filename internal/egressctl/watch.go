package egressctl

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"

	"github.com/fsnotify/fsnotify"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// cgroupWatch wakes the controller when a selected workload's cgroup may have
// been made: kubelet makes a pod's cgroup before the pod's containers start,
// and systemd a unit's before its process, so a sync at that moment selects
// the workload before it can connect. The resync (Config.Resync) finds the
// same cgroups later, when inotify is unavailable or out of watches.
type cgroupWatch struct {
	w   *fsnotify.Watcher // nil: no inotify
	log *slog.Logger

	mu      sync.Mutex
	dirs    map[string]bool // watched
	targets map[string]bool // the base names of the units' cgroups
	warned  bool            // a failed watch was logged at warn level
}

func newCgroupWatch(log *slog.Logger) *cgroupWatch {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		log.Warn("egress: no inotify watch of the cgroup tree: new workloads are found at the next resync", "err", err)
	}
	return &cgroupWatch{w: w, log: log, dirs: map[string]bool{}, targets: map[string]bool{}}
}

// set watches dirs and no others, and wakes for pods' cgroups and the named
// units' made in them. It reports whether a directory was added: a cgroup made
// there between the walk and the watch was seen by neither.
func (cw *cgroupWatch) set(dirs []string, units map[string]bool) (added bool) {
	if cw.w == nil {
		return false
	}
	cw.mu.Lock()
	defer cw.mu.Unlock()
	cw.targets = units
	want := map[string]bool{}
	for _, d := range dirs {
		want[d] = true
		if cw.dirs[d] {
			continue
		}
		if err := cw.w.Add(d); err != nil {
			lvl := slog.LevelDebug
			if !cw.warned {
				lvl, cw.warned = slog.LevelWarn, true
			}
			cw.log.Log(context.Background(), lvl, "egress: no inotify watch of a cgroup directory: its new workloads are found at the next resync", "dir", d, "err", err)
			continue
		}
		cw.dirs[d], added = true, true
	}
	for d := range cw.dirs {
		if !want[d] {
			_ = cw.w.Remove(d) // gone already, or no longer a parent
			delete(cw.dirs, d)
		}
	}
	return added
}

// wakes reports whether a directory made as name may be a workload's cgroup.
func (cw *cgroupWatch) wakes(name string) bool {
	base := filepath.Base(name)
	if workload.PodUID(base) != "" || strings.Contains(name, "kubepods") {
		return true
	}
	cw.mu.Lock()
	defer cw.mu.Unlock()
	return cw.targets[base]
}

// run calls kick for every directory made that wakes, until ctx ends.
func (cw *cgroupWatch) run(ctx context.Context, kick func()) {
	if cw.w == nil {
		return
	}
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-cw.w.Events:
			if !ok {
				return
			}
			if ev.Has(fsnotify.Create) && cw.wakes(ev.Name) {
				kick()
			}
		case err, ok := <-cw.w.Errors:
			if !ok {
				return
			}
			// An overflow loses events: look now.
			cw.log.Debug("egress: cgroup watch", "err", err)
			kick()
		}
	}
}

func (cw *cgroupWatch) close() {
	if cw.w != nil {
		cw.w.Close()
	}
}
