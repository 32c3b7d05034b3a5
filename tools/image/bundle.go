package main

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// listFlag collects a repeated flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// runBundle builds a small single-layer linux/amd64 image from files of this
// machine: the test node's workload images (a pause container, clients built
// against glibc or musl, static Go programs). A host binary is copied with every
// library it links against (found as the dynamic loader would, in the
// multiarch directories), so an image of Debian's getent and dig needs no list
// of packages; the same ELF check as the agent's image then proves nothing is
// missing.
//
//	image bundle -name localhost/x -tag v1 -out DIR [-epoch S] [-entrypoint /p]
//	             [-host PATH]... [-file DEST=SRC]... [-text DEST=CONTENT]...
//
// It writes DIR/oci (an OCI layout) and DIR/image.oci.tar (for `ctr images import`).
func runBundle(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("image bundle", flag.ContinueOnError)
	var hosts, files, texts listFlag
	var name, tag, out, entry string
	var epoch int64
	fs.StringVar(&name, "name", "", "image name, e.g. localhost/nodetest-glibc")
	fs.StringVar(&tag, "tag", "v1", "tag")
	fs.StringVar(&out, "out", "", "output directory")
	fs.StringVar(&entry, "entrypoint", "", "entrypoint (an absolute path in the image); empty: none")
	fs.Int64Var(&epoch, "epoch", 0, "timestamp of every file, in seconds")
	fs.Var(&hosts, "host", "a binary of this machine, copied to the same path with the libraries it needs (repeatable)")
	fs.Var(&files, "file", "DEST=SRC: a file copied to DEST in the image, mode kept (repeatable)")
	fs.Var(&texts, "text", "DEST=CONTENT: a small text file (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if name == "" || out == "" {
		return fmt.Errorf("bundle: -name and -out are required")
	}
	pf := platforms["amd64"]
	t := fsTree{}
	for _, h := range hosts {
		if err := t.addHostBinary(h, pf); err != nil {
			return err
		}
	}
	for _, f := range files {
		dest, src, ok := strings.Cut(f, "=")
		if !ok {
			return fmt.Errorf("-file %q: want DEST=SRC", f)
		}
		if err := t.addHostFile(cleanName(dest), src, "-file"); err != nil {
			return err
		}
	}
	for _, f := range texts {
		dest, content, ok := strings.Cut(f, "=")
		if !ok {
			return fmt.Errorf("-text %q: want DEST=CONTENT", f)
		}
		if err := t.put(cleanName(dest), &file{mode: 0o644, data: []byte(content + "\n"), origin: "-text"}); err != nil {
			return err
		}
	}
	for _, d := range []string{"tmp", "proc", "sys", "dev", "etc", "run", "var"} {
		if _, ok := t[d]; !ok {
			t[d] = &file{dir: true, mode: 0o755, origin: "image"}
		}
	}
	t["tmp"].mode = 0o1777
	if err := t.checkLinks(); err != nil {
		return err
	}
	checked, err := checkELF(t, pf)
	if err != nil {
		return err
	}
	img, err := singleLayerImage(t, pf, time.Unix(epoch, 0).UTC(), entry, name+":"+tag)
	if err != nil {
		return err
	}
	idx := mutate.AppendManifests(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), mutate.IndexAddendum{
		Add:        img,
		Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: pf.arch}},
	})
	if err := writeLayout(filepath.Join(out, "oci"), idx, name, tag); err != nil {
		return err
	}
	archive := filepath.Join(out, "image.oci.tar")
	if err := writeArchive(filepath.Join(out, "oci"), archive, time.Unix(epoch, 0).UTC()); err != nil {
		return fmt.Errorf("write %s: %w", archive, err)
	}
	fmt.Fprintf(stdout, "%s:%s: %d files, %s, %d ELF files checked; wrote %s\n", name, tag, len(t), mib(t.size()), checked, archive)
	return nil
}

// singleLayerImage is an image of one layer holding t. Test images are built
// on every run and never pushed: gzip favours speed over size.
func singleLayerImage(t fsTree, pf platform, epoch time.Time, entry, ref string) (v1.Image, error) {
	cfg := v1.Config{Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}, WorkingDir: "/"}
	if entry != "" {
		cfg.Entrypoint = []string{entry}
	}
	return assemble(pf, epoch, gzip.BestSpeed, []layerSpec{{t, "image bundle " + ref}}, cfg)
}

// addHostFile copies the file at src (symlinks followed) to name.
func (t fsTree) addHostFile(name, src, origin string) error {
	st, err := os.Stat(src)
	if err != nil {
		return fmt.Errorf("%s: %w", origin, err)
	}
	b, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("%s: %w", origin, err)
	}
	return t.put(name, &file{mode: int64(st.Mode().Perm()), data: b, origin: origin + " " + src})
}

// addHostBinary copies the binary at p and, transitively, its program
// interpreter and every DT_NEEDED library, each from where the loader finds it.
func (t fsTree) addHostBinary(p string, pf platform) error {
	queue := []string{p}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		name := cleanName(cur)
		if _, done := t[name]; done {
			continue
		}
		if err := t.addHostFile(name, cur, "-host"); err != nil {
			return err
		}
		deps, err := elfDeps(t[name].data, pf)
		if err != nil {
			return fmt.Errorf("%s: %w", cur, err)
		}
		queue = append(queue, deps...)
	}
	return nil
}

// elfDeps returns the host paths of an ELF file's interpreter and libraries
// (nothing for a static binary or a non-ELF file).
func elfDeps(data []byte, pf platform) ([]string, error) {
	if !bytes.HasPrefix(data, []byte(elf.ELFMAG)) {
		return nil, nil
	}
	ef, err := elf.NewFile(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	defer ef.Close()
	var out []string
	for _, prog := range ef.Progs {
		if prog.Type == elf.PT_INTERP {
			b := make([]byte, prog.Filesz)
			if _, err := prog.ReadAt(b, 0); err != nil {
				return nil, err
			}
			out = append(out, strings.TrimRight(string(b), "\x00"))
		}
	}
	libs, err := ef.ImportedLibraries()
	if err != nil {
		return nil, err
	}
	for _, lib := range libs {
		found := ""
		for _, d := range []string{"/lib/" + pf.triplet, "/usr/lib/" + pf.triplet, "/lib", "/usr/lib"} {
			if _, err := os.Stat(path.Join(d, lib)); err == nil {
				found = path.Join(d, lib)
				break
			}
		}
		if found == "" {
			return nil, fmt.Errorf("needs %s, not found on this machine", lib)
		}
		out = append(out, found)
	}
	return out, nil
}
