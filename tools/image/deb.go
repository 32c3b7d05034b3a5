package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"

	"github.com/ulikunitz/xz"
)

// debPackage is one line of the lock file: an exact .deb for one architecture.
type debPackage struct {
	Name, Version, Arch, SHA256, Filename string
	Size                                  int64
}

// readLock returns the lock's packages for arch, in the lock's order.
func readLock(file, arch string) ([]debPackage, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("read lock: %w", err)
	}
	defer f.Close()
	var out []debPackage
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fs := strings.Fields(line)
		if len(fs) != 6 {
			return nil, fmt.Errorf("%s:%d: want 6 fields (package version arch sha256 size filename), got %d", file, n, len(fs))
		}
		size, err := strconv.ParseInt(fs[4], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: size %q: %w", file, n, fs[4], err)
		}
		if fs[2] == arch {
			out = append(out, debPackage{Name: fs[0], Version: fs[1], Arch: fs[2], SHA256: fs[3], Size: size, Filename: fs[5]})
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read lock: %w", err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s has no packages for %s (make image-lock IMAGE_ARCHES=...)", file, arch)
	}
	return out, nil
}

// CachePath is where scripts/image-debs.sh keeps this package's .deb.
func (p debPackage) CachePath(dir string) string { return path.Join(dir, path.Base(p.Filename)) }

// readDebData calls fn for every entry of a .deb's data.tar. A .deb is an ar
// archive: debian-binary, control.tar.*, data.tar.* (gz or xz).
func readDebData(deb []byte, fn func(*tar.Header, io.Reader) error) error {
	const magic = "!<arch>\n"
	if !bytes.HasPrefix(deb, []byte(magic)) {
		return errors.New("not an ar archive")
	}
	r := deb[len(magic):]
	for len(r) >= 60 {
		hdr := r[:60]
		name := strings.TrimRight(strings.TrimSpace(string(hdr[:16])), "/")
		size, err := strconv.ParseInt(strings.TrimSpace(string(hdr[48:58])), 10, 64)
		if err != nil || size < 0 || size > int64(len(r)-60) {
			return fmt.Errorf("ar member %q: bad size", name)
		}
		body := r[60 : 60+size]
		r = r[60+size:]
		if size%2 == 1 && len(r) > 0 {
			r = r[1:] // members are 2-byte aligned
		}
		if !strings.HasPrefix(name, "data.tar") {
			continue
		}
		var dec io.Reader
		switch path.Ext(name) {
		case ".xz":
			if dec, err = xz.NewReader(bytes.NewReader(body)); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		case ".gz":
			if dec, err = gzip.NewReader(bytes.NewReader(body)); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		case ".tar":
			dec = bytes.NewReader(body)
		default:
			return fmt.Errorf("%s: unsupported compression", name)
		}
		tr := tar.NewReader(dec)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			if err := fn(h, tr); err != nil {
				return err
			}
		}
	}
	return errors.New("no data.tar member")
}
