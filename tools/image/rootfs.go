package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"time"
)

// file is one entry of a layer: a regular file or a symlink (directories are
// implied by the paths and written with mode 0755, or given explicitly).
type file struct {
	mode   int64 // permission bits (and the sticky bit for /tmp)
	link   string
	data   []byte
	dir    bool
	origin string // package (or "image") that supplied it, for error messages
}

// fsTree is a layer's content keyed by clean relative path ("usr/sbin/iptables").
type fsTree map[string]*file

// excluded are dropped from the Debian packages: nothing at run time reads them.
// glibc's gconv modules serve iconv(3), which iptables does not call.
func excluded(name, triplet string) bool {
	for _, p := range []string{
		"usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/lintian",
		"usr/share/locale", "usr/share/bug", "usr/lib/" + triplet + "/gconv",
	} {
		if name == p || strings.HasPrefix(name, p+"/") {
			return true
		}
	}
	return false
}

// cleanName turns "./usr/bin/x" or "/usr/bin/x" into "usr/bin/x"; "" for the root.
func cleanName(n string) string {
	n = path.Clean("/" + n)
	return strings.TrimPrefix(n, "/")
}

// addDeb adds a .deb's files (not its directories: they are implied) to t.
func (t fsTree) addDeb(pkg string, deb []byte, triplet string) error {
	hardlinks := map[string]string{}
	err := readDebData(deb, func(h *tar.Header, r io.Reader) error {
		name := cleanName(h.Name)
		if name == "" || excluded(name, triplet) {
			return nil
		}
		switch h.Typeflag {
		case tar.TypeDir:
			return nil
		case tar.TypeReg:
			b, err := io.ReadAll(r)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return t.put(name, &file{mode: int64(h.FileInfo().Mode().Perm()), data: b, origin: pkg})
		case tar.TypeSymlink:
			return t.put(name, &file{mode: 0o777, link: h.Linkname, origin: pkg})
		case tar.TypeLink:
			hardlinks[name] = cleanName(h.Linkname)
			return nil
		default:
			return fmt.Errorf("%s: unsupported tar entry type %q", name, h.Typeflag)
		}
	})
	if err != nil {
		return fmt.Errorf("%s: %w", pkg, err)
	}
	// Hard links become copies: one entry per path, independent of tar order.
	for name, target := range hardlinks {
		src, ok := t[target]
		if !ok || src.dir || src.link != "" {
			return fmt.Errorf("%s: hard link %s -> %s: target is not a regular file of the image", pkg, name, target)
		}
		c := *src
		c.origin = pkg
		if err := t.put(name, &c); err != nil {
			return err
		}
	}
	return nil
}

// put adds f at name; the same path from two sources must be identical.
func (t fsTree) put(name string, f *file) error {
	if old, ok := t[name]; ok {
		if old.dir && f.dir {
			return nil
		}
		if old.dir != f.dir || old.link != f.link || !bytes.Equal(old.data, f.data) {
			return fmt.Errorf("%s: supplied differently by %s and %s", name, old.origin, f.origin)
		}
		return nil
	}
	t[name] = f
	return nil
}

// resolve follows symlinks inside the tree (absolute links are relative to the
// tree's root) and returns the path of the final entry, or false when a link
// dangles, loops or leaves the tree.
func (t fsTree) resolve(name string) (string, bool) {
	for hops := 0; hops < 32; hops++ {
		// Resolve symlinked parent directories too.
		parts := strings.Split(name, "/")
		changed := false
		for i := 1; i < len(parts); i++ {
			dir := strings.Join(parts[:i], "/")
			if f, ok := t[dir]; ok && f.link != "" {
				name = cleanName(joinLink(dir, f.link) + "/" + strings.Join(parts[i:], "/"))
				changed = true
				break
			}
		}
		if changed {
			continue
		}
		f, ok := t[name]
		if !ok {
			return "", false
		}
		if f.link == "" {
			return name, true
		}
		name = cleanName(joinLink(name, f.link))
	}
	return "", false
}

// joinLink is the path a symlink at name pointing to target refers to.
func joinLink(name, target string) string {
	if strings.HasPrefix(target, "/") {
		return target
	}
	return path.Join(path.Dir(name), target)
}

// checkLinks fails on a symlink that points at nothing in the tree (a file the
// exclusions dropped, or a package left out of the lock).
func (t fsTree) checkLinks() error {
	var bad []string
	for _, name := range t.sorted() {
		if t[name].link == "" {
			continue
		}
		if _, ok := t.resolve(name); !ok {
			bad = append(bad, name+" -> "+t[name].link)
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("dangling symlinks in the image: %s", strings.Join(bad, ", "))
	}
	return nil
}

func (t fsTree) sorted() []string {
	names := make([]string, 0, len(t))
	for n := range t {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// writeTar writes t as a tar stream with every parent directory, sorted by
// path, owned by 0:0, with the same modification time on every entry: the
// bytes depend only on the content.
func (t fsTree) writeTar(w io.Writer, mtime time.Time) error {
	all := fsTree{}
	for name, f := range t {
		all[name] = f
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			if _, ok := all[d]; !ok {
				all[d] = &file{dir: true, mode: 0o755}
			}
		}
	}
	tw := tar.NewWriter(w)
	for _, name := range all.sorted() {
		f := all[name]
		// Format left unset: USTAR unless a field needs PAX, ModTime rounded to
		// the second, no access or change times.
		h := &tar.Header{Name: name, Mode: f.mode, ModTime: mtime}
		switch {
		case f.dir:
			h.Typeflag, h.Name = tar.TypeDir, name+"/"
		case f.link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.link
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return fmt.Errorf("tar %s: %w", name, err)
		}
		if h.Typeflag == tar.TypeReg {
			if _, err := tw.Write(f.data); err != nil {
				return fmt.Errorf("tar %s: %w", name, err)
			}
		}
	}
	return tw.Close()
}

// size is the sum of the regular files' sizes.
func (t fsTree) size() int64 {
	var n int64
	for _, f := range t {
		n += int64(len(f.data))
	}
	return n
}

// readFileChecked reads a cached .deb and checks its SHA-256 against the lock.
func readFileChecked(p debPackage, dir string) ([]byte, error) {
	b, err := os.ReadFile(p.CachePath(dir))
	if err != nil {
		return nil, fmt.Errorf("%s=%s (%s): %w (run scripts/image-debs.sh fetch %s)", p.Name, p.Version, p.Arch, err, p.Arch)
	}
	if got := fmt.Sprintf("%x", sha256.Sum256(b)); got != p.SHA256 {
		return nil, fmt.Errorf("%s: sha256 %s, lock says %s", p.CachePath(dir), got, p.SHA256)
	}
	return b, nil
}
