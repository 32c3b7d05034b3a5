package redirect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf/link"
)

// Handoff tells the datapath that a successor adopted it: Close then releases
// only this process's file descriptors, leaving the registered resolver sockets
// (now shared with the successor), the links and the pins alone.
func (d *Datapath) Handoff() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.handoff = true
}

// Discard makes Close remove what Start attached and pinned itself (for an
// agent whose start failed: it leaves nothing behind), while links it adopted
// stay pinned as they were found.
func (d *Datapath) Discard() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.discard = true
}

// DetachOnClose makes Close detach the programs and remove every pin, as
// Config.Detach does (an uninstall decided while the datapath runs). A
// handoff still wins: the successor's links stay.
func (d *Datapath) DetachOnClose() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.set.cfg.Detach = true
}

// Reassert makes this datapath current again after a successor that had
// started to take it over failed: this datapath's programs go back into the
// pinned links and its configuration into the maps. The caller registers its
// resolver sockets again (Serve).
func (d *Datapath) Reassert() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || d.objs.Config == nil {
		return errors.New("datapath is not started or closed")
	}
	var errs []error
	progs := d.programsByName()
	for i, a := range d.links {
		err := a.link.Update(progs[a.hook.name])
		if err != nil {
			// The successor may have replaced our link by one in front of
			// another program (relink): the program goes into the pinned one.
			var l link.Link
			if l, err = link.LoadPinnedLink(a.pin, nil); err == nil {
				if err = l.Update(progs[a.hook.name]); err == nil {
					a.link.Close()
					d.links[i].link = l
					if info, ierr := l.Info(); ierr == nil {
						d.links[i].id = info.ID
					}
				} else {
					l.Close()
				}
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("put the program of %s back: %w", a.hook.name, err))
		}
	}
	errs = append(errs, d.writeConfig(d.netns))
	return errors.Join(errs...)
}

// Close stops the watchdog and unregisters the resolver sockets registered
// with Serve (capture stops), unless Handoff was called. With Config.Detach (and
// no handoff) it then detaches every program and removes every pin (and the
// pin directory when it is then empty); otherwise links and maps stay pinned,
// and attached but inert, for the next agent to adopt. It closes this process's
// file descriptors in every case. Close is idempotent and safe after a failed
// or missing Start.
func (d *Datapath) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	stop, done := d.stopWD, d.wdDone
	d.mu.Unlock()
	if stop != nil {
		stop()
		<-done
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.started {
		// Loaded at most: only descriptors to close.
		d.loaded = nil
		err := d.objs.Close()
		d.objs = redirectObjects{}
		return err
	}
	if d.objs.Config == nil {
		return nil
	}
	detached, err := d.releaseLocked(false)
	if err != nil {
		return err
	}
	switch {
	case d.handoff:
		d.log.Info("eBPF datapath handed over to the successor")
	case detached:
		d.log.Info("eBPF datapath detached", "cgroup", d.set.cfg.Cgroup)
	default:
		d.log.Info("eBPF datapath left attached and pinned (inert) for the next agent", "pin_dir", d.pinDir)
	}
	return nil
}

// releaseLocked releases what Start acquired, with d.mu held and the watchdog
// stopped: it is Close's release and Start's rollback. Unless handed off, the
// registered resolver sockets are unregistered. With Detach (and no handoff)
// every link is detached and every pin removed; with Discard only the links
// and map pins this Start made (and the pin directory when Start made it and
// it is empty), adopted links staying as they were found. Every descriptor is
// closed. A rollback (a failed Start) releases as Discard does, whatever
// Detach says. detached reports that every link was detached.
func (d *Datapath) releaseLocked(rollback bool) (detached bool, err error) {
	if d.probe != nil {
		d.probe.Close()
		d.probe = nil
	}
	var errs []error
	if !d.handoff {
		errs = append(errs, d.unserveLocked())
	}
	detach := d.set.cfg.Detach && !d.handoff && !rollback
	discard := (d.discard || rollback) && !d.handoff
	detached = detach || discard
	for _, a := range d.links {
		if detach || (discard && !a.adopted) {
			if err := a.link.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) {
				errs = append(errs, fmt.Errorf("detach %s: %w", a.hook.section, err))
			}
			if err := a.link.Unpin(); err != nil {
				errs = append(errs, fmt.Errorf("unpin link %s: %w", a.pin, err))
			}
		}
		detached = detached && (detach || !a.adopted)
		if err := a.link.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close link %s: %w", a.hook.name, err))
		}
	}
	d.links = nil
	errs = append(errs, d.removePinsLocked(detach, discard)...)
	d.dequeued.Store(nil)
	if err := d.clock.close(); err != nil {
		errs = append(errs, fmt.Errorf("close the watch clock: %w", err))
	}
	d.clock = nil
	if d.progress != nil {
		d.progress.close()
		d.progress = nil
	}
	d.flows.close()
	d.flows = nil
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close eBPF objects: %w", err))
	}
	d.objs, d.loaded = redirectObjects{}, nil
	return detached, errors.Join(errs...)
}

// removePinsLocked removes the map pins: every one with detach, those this
// Start made with discard; then the pin directories when they are empty and
// ours to remove.
func (d *Datapath) removePinsLocked(detach, discard bool) []error {
	var errs []error
	var pins []string
	switch {
	case detach:
		for name := range d.mapsByName() {
			pins = append(pins, filepath.Join(d.pinDir, mapsDir, name))
		}
	case discard:
		pins = d.ownPins
	}
	for _, p := range pins {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin map %s: %w", filepath.Base(p), err))
		}
	}
	d.ownPins = nil
	if detach || (discard && d.madePinDir) {
		errs = append(errs, removeEmptyPinDirs(d.pinDir)...)
	}
	return errs
}
