package redirect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf/link"
)

// checkPinDir reports a clear error unless dir is, or would be created, on a bpffs.
func checkPinDir(dir string) error {
	p := filepath.Clean(dir)
	for {
		fi, err := os.Stat(p)
		if err == nil {
			if !fi.IsDir() {
				return fmt.Errorf("pin path %s is not a directory", p)
			}
			break
		}
		if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("pin directory %s: %w", dir, err)
		}
		parent := filepath.Dir(p)
		if parent == p {
			return fmt.Errorf("pin directory %s: no existing parent", dir)
		}
		p = parent
	}
	fsType, ok, err := OnBPFFS(p)
	if err != nil {
		return fmt.Errorf("statfs pin directory %s: %w", p, err)
	}
	if !ok {
		return fmt.Errorf("pin directory %s is not on a bpffs (%s has filesystem type %#x); mount one first, e.g. mount -t bpf bpf /sys/fs/bpf", dir, p, fsType)
	}
	return nil
}

// Cleanup removes the links and maps an agent left pinned under pinDir (a crashed
// agent, or one stopped with persist). Removing a link's pin detaches its program
// once no process holds the link open any more. It returns the removed pins. A
// pinDir that does not exist is not an error.
func Cleanup(pinDir string) (removed []string, err error) {
	if _, err := os.Stat(pinDir); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, fmt.Errorf("pin directory %s: %w", pinDir, err)
	}
	if err := checkPinDir(pinDir); err != nil {
		return nil, err
	}
	var errs []error
	// Links first: once they are gone nothing uses the maps any more.
	for _, sub := range []string{linksDir, mapsDir} {
		dir := filepath.Join(pinDir, sub)
		entries, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("read %s: %w", dir, err))
			continue
		}
		for _, e := range entries {
			p := filepath.Join(dir, e.Name())
			if e.IsDir() {
				continue
			}
			if sub == linksDir {
				if err := detachPinnedLink(p); err != nil {
					errs = append(errs, err)
					continue
				}
			} else if err := os.Remove(p); err != nil {
				errs = append(errs, fmt.Errorf("remove pin %s: %w", p, err))
				continue
			}
			removed = append(removed, p)
		}
	}
	errs = append(errs, removeEmptyPinDirs(pinDir)...)
	return removed, errors.Join(errs...)
}

// detachPinnedLink detaches the link pinned at p right away (BPF_LINK_DETACH, even
// if another process still holds it open) and removes the pin. Only removing the
// pin would detach asynchronously, after the kernel drops its last reference.
func detachPinnedLink(p string) error {
	l, err := link.LoadPinnedLink(p, nil)
	if err != nil {
		// Not a loadable link (or a kernel without links): removing the pin is
		// all that is left to do.
		if rmErr := os.Remove(p); rmErr != nil {
			return fmt.Errorf("remove pin %s: %w (open: %v)", p, rmErr, err)
		}
		return nil
	}
	defer l.Close()
	if err := l.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) {
		return fmt.Errorf("detach link pinned at %s: %w", p, err)
	}
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("unpin link %s: %w", p, err)
	}
	return nil
}
