package redirect

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// checkCgroup2Dir reports a clear error unless dir is a directory on a cgroup2
// filesystem.
func checkCgroup2Dir(dir string) error {
	fi, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("cgroup directory %s does not exist", dir)
	}
	if err != nil {
		return fmt.Errorf("cgroup directory %s: %w", dir, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("cgroup path %s is not a directory", dir)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("statfs cgroup directory %s: %w", dir, err)
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		hint := ""
		if m, err := FindCgroup2Mount(); err == nil {
			hint = fmt.Sprintf("; the cgroup2 hierarchy is mounted at %s", m)
		}
		return fmt.Errorf("cgroup directory %s is not on a cgroup2 filesystem (filesystem type %#x)%s", dir, st.Type, hint)
	}
	return nil
}

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
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		return fmt.Errorf("statfs pin directory %s: %w", p, err)
	}
	if st.Type != unix.BPF_FS_MAGIC {
		return fmt.Errorf("pin directory %s is not on a bpffs (%s has filesystem type %#x); mount one first, e.g. mount -t bpf bpf /sys/fs/bpf", dir, p, st.Type)
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

// FindCgroup2Mount returns the mount point of the cgroup v2 hierarchy (the first
// cgroup2 mount whose root is the hierarchy's root), from /proc/self/mountinfo.
func FindCgroup2Mount() (string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	first := ""
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional...] - fstype source super
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+1 >= len(fields) || len(fields) < 5 || fields[sep+1] != "cgroup2" {
			continue
		}
		mp := unescapeMount(fields[4])
		if fields[3] == "/" {
			return mp, nil
		}
		if first == "" {
			first = mp
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mountinfo: %w", err)
	}
	if first != "" {
		return first, nil
	}
	return "", errors.New("no cgroup2 filesystem is mounted")
}

// unescapeMount undoes the octal escapes of /proc/self/mountinfo (\040 etc.).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// cgroupPaths resolves cgroup v2 ids to directories by walking the cgroup2 mount:
// a cgroup's id is the inode number of its directory. Ids not found (cgroups
// removed since) are absent from the result.
func cgroupPaths(ids []uint64) map[uint64]string {
	out := map[uint64]string{}
	if len(ids) == 0 {
		return out
	}
	want := map[uint64]bool{}
	for _, id := range ids {
		want[id] = true
	}
	root, err := FindCgroup2Mount()
	if err != nil {
		return out
	}
	_ = filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if p == root {
				return err
			}
			return fs.SkipDir
		}
		if !e.IsDir() {
			return nil
		}
		fi, err := e.Info()
		if err != nil {
			return nil
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && want[st.Ino] {
			out[st.Ino] = p
			if len(out) == len(want) {
				return fs.SkipAll
			}
		}
		return nil
	})
	return out
}
