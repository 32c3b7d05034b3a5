package redirect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// attach adopts each pinned link that is attached to our cgroup with the hook's
// attach type (replacing its program atomically), and attaches and pins a new
// link for the others.
func (d *Datapath) attach() error {
	cgPath := d.set.cfg.Cgroup
	cg, err := os.Open(cgPath)
	if err != nil {
		return fmt.Errorf("open cgroup %s: %w", cgPath, err)
	}
	defer cg.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(cg.Fd()), &st); err != nil {
		return fmt.Errorf("stat cgroup %s: %w", cgPath, err)
	}
	cgID := st.Ino // a cgroup's id is the inode of its directory
	dir := filepath.Join(d.pinDir, linksDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	progs := d.programsByName()
	for _, h := range hooks {
		p := filepath.Join(dir, h.name)
		prog := progs[h.name]
		if l, ok := d.adoptable(p, h, cgID); ok {
			// A link behind another program (attached on an older kernel, or
			// before another datapath attached in front of it) is replaced
			// by one in front, where the kernel can; else its program is.
			var ahead bool
			if d.order.Supported && ordersHook(h) {
				var oldProg ebpf.ProgramID
				if info, err := l.Info(); err == nil {
					oldProg = info.Program
				}
				behind, err := foreignBefore(cg, h, map[ebpf.ProgramID]bool{oldProg: true, programID(prog): true})
				if err != nil {
					d.log.Warn("cannot tell whether the adopted link runs first", "hook", h.name, "err", err)
				}
				if behind {
					nl, err := d.relink(cg, prog, h, l, p)
					switch {
					case errors.Is(err, unix.EINVAL):
						// A kernel without ordered cgroup programs (a restart
						// that adopts every link attaches nothing new, so
						// this is where it shows): keep the link's place.
						d.order = Ordering{Reason: fmt.Sprintf("the kernel refused ordered cgroup attach (%v)", err)}
						d.log.Info("no ordered cgroup programs on this kernel: the adopted link stays behind the other program", "hook", h.name, "err", err)
					case err != nil:
						l.Close()
						return err
					default:
						l, ahead = nl, true
						d.log.Info("adopted link ran behind another program: replaced by one in front", "hook", h.name)
					}
				}
			}
			if !ahead {
				if err := l.Update(prog); err != nil {
					l.Close()
					return fmt.Errorf("replace the program of the pinned link %s: %w", p, err)
				}
			}
			// A relinked link counts as adopted too: a failed start leaves it
			// pinned, as it found the link it replaced, for the predecessor.
			a := attached{hook: h, link: l, pin: p, adopted: true}
			if info, err := l.Info(); err == nil {
				a.id = info.ID
			}
			d.links = append(d.links, a)
			continue
		}
		// A pin that is not ours to adopt (another cgroup, another hook): gone.
		if _, err := os.Stat(p); err == nil {
			if err := detachPinnedLink(p); err != nil {
				return err
			}
		}
		l, err := d.attachNew(cg, prog, h)
		if err != nil {
			hint := permissionHint(err)
			if errors.Is(err, unix.EPERM) {
				hint = " (another program may be attached to this cgroup exclusively, without BPF_F_ALLOW_MULTI; or CAP_NET_ADMIN is missing)"
			}
			return fmt.Errorf("attach %s (%s) to cgroup %s: %w%s", h.section, h.attachName, cgPath, err, hint)
		}
		a := attached{hook: h, link: l, pin: p}
		if info, err := l.Info(); err == nil {
			a.id = info.ID
		}
		d.links = append(d.links, a)
		if err := l.Pin(p); err != nil {
			return fmt.Errorf("pin link of %s at %s: %w", h.section, p, err)
		}
	}
	return nil
}

// adoptable opens the link pinned at p when it attaches h's attach type to the
// cgroup cgID.
func (d *Datapath) adoptable(p string, h hook, cgID uint64) (link.Link, bool) {
	l, err := link.LoadPinnedLink(p, nil)
	if err != nil {
		return nil, false
	}
	info, err := l.Info()
	if err != nil {
		l.Close()
		return nil, false
	}
	cg := info.Cgroup()
	if cg == nil || cg.CgroupId != cgID || ebpf.AttachType(cg.AttachType) != h.attach {
		l.Close()
		return nil, false
	}
	return l, true
}

// removeForeignPins detaches and removes pins under pinDir that are not ours:
// links and maps of an older version with other programs or maps.
func removeForeignPins(pinDir string) error {
	ours := map[string]bool{}
	for _, h := range hooks {
		ours[filepath.Join(pinDir, linksDir, h.name)] = true
	}
	for name := range new(Datapath).mapsByName() {
		ours[filepath.Join(pinDir, mapsDir, name)] = true
	}
	var errs []error
	for _, sub := range []string{linksDir, mapsDir} {
		entries, err := os.ReadDir(filepath.Join(pinDir, sub))
		if err != nil {
			continue
		}
		for _, e := range entries {
			p := filepath.Join(pinDir, sub, e.Name())
			if ours[p] || e.IsDir() {
				continue
			}
			if sub == linksDir {
				errs = append(errs, detachPinnedLink(p))
			} else if err := os.Remove(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// removeEmptyPinDirs removes links/, maps/ and the pin directory itself when they
// are empty.
func removeEmptyPinDirs(pinDir string) []error {
	var errs []error
	for _, p := range []string{filepath.Join(pinDir, linksDir), filepath.Join(pinDir, mapsDir), pinDir} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) {
			errs = append(errs, fmt.Errorf("remove %s: %w", p, err))
		}
	}
	return errs
}
