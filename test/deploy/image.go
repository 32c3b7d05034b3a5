package deploy

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// imageBuild is one `make image` from a clean checkout.
type imageBuild struct {
	checkout string        // where HEAD was extracted
	out      string        // IMAGE_OUT: oci/, meshdns-ebpf.oci.tar, digest
	digest   string        // the index digest
	took     time.Duration // wall time of make image
	log      string        // what make printed
}

// buildInputs are what both builds share: a build from the same inputs must give
// the same digest.
type buildInputs struct {
	version, revision, epoch string
	cache                    string // IMAGE_CACHE: the .debs, fetched once
	lock                     string // IMAGE_LOCK: the committed lock, or a fresh one when it is stale
}

func headInputs(root string) (buildInputs, error) {
	git := func(args ...string) (string, error) {
		out, err := exec.Command("git", append([]string{"-C", root}, args...)...).Output()
		if err != nil {
			return "", fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
		}
		return strings.TrimSpace(string(out)), nil
	}
	rev, err := git("rev-parse", "HEAD")
	if err != nil {
		return buildInputs{}, err
	}
	epoch, err := git("log", "-1", "--format=%ct")
	if err != nil {
		return buildInputs{}, err
	}
	cache := os.Getenv("IMAGE_CACHE")
	if cache == "" {
		cache = filepath.Join(root, ".cache", "image")
	}
	return buildInputs{version: rev[:12], revision: rev, epoch: epoch, cache: cache,
		lock: filepath.Join(root, "deploy", "image", "debs.lock")}, nil
}

// ensureDebs fetches the .debs of the committed lock. Debian replaces
// package versions on its mirrors (security and point releases); when a
// locked version is not served any more, a fresh lock is resolved into
// dir and used instead, so the reproducibility checks still run (both
// builds use the same fresh inputs). The stale lock is reported: commit
// the output of `make image-lock`.
func ensureDebs(root, dir string, in *buildInputs) (stale string, err error) {
	fetch := func(lock string) ([]byte, error) {
		cmd := exec.Command(filepath.Join(root, "scripts", "image-debs.sh"), "fetch", "amd64")
		cmd.Env = append(os.Environ(), "IMAGE_CACHE="+in.cache, "IMAGE_LOCK="+lock)
		return cmd.CombinedOutput()
	}
	out, err := fetch(in.lock)
	if err == nil {
		return "", nil
	}
	if !strings.Contains(string(out), "is not served any more") {
		return "", fmt.Errorf("fetch the image's Debian packages: %w\n%s", err, out)
	}
	fresh := filepath.Join(dir, "debs.lock")
	cmd := exec.Command(filepath.Join(root, "scripts", "image-debs.sh"), "lock", "amd64")
	cmd.Env = append(os.Environ(), "IMAGE_CACHE="+in.cache, "IMAGE_LOCK="+fresh)
	if lout, lerr := cmd.CombinedOutput(); lerr != nil {
		return "", fmt.Errorf("the committed lock is stale (%s) and a fresh one failed: %w\n%s", strings.TrimSpace(string(out)), lerr, lout)
	}
	if fout, ferr := fetch(fresh); ferr != nil {
		return "", fmt.Errorf("fetch with a fresh lock: %w\n%s", ferr, fout)
	}
	in.lock = fresh
	return strings.TrimSpace(string(out)), nil
}

// buildFromCleanCheckout extracts HEAD of root (git archive: committed files only)
// into dir and runs `make image` there.
func buildFromCleanCheckout(root, dir string, in buildInputs) (*imageBuild, error) {
	b := &imageBuild{checkout: filepath.Join(dir, "src"), out: filepath.Join(dir, "out")}
	if err := gitArchive(root, b.checkout); err != nil {
		return nil, err
	}
	cmd := exec.Command("make", "-C", b.checkout, "image",
		"IMAGE_CACHE="+in.cache, "IMAGE_LOCK="+in.lock, "IMAGE_OUT="+b.out, "VERSION="+in.version,
		"REVISION="+in.revision, "SOURCE_DATE_EPOCH="+in.epoch)
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "MAKEFLAGS=") && !strings.HasPrefix(e, "MFLAGS=") && !strings.HasPrefix(e, "MAKELEVEL=") {
			env = append(env, e)
		}
	}
	cmd.Env = env
	start := time.Now()
	out, err := cmd.CombinedOutput()
	b.took, b.log = time.Since(start), string(out)
	if err != nil {
		return b, fmt.Errorf("make image in %s: %w\n%s", b.checkout, err, out)
	}
	d, err := os.ReadFile(filepath.Join(b.out, "digest"))
	if err != nil {
		return b, err
	}
	b.digest = strings.TrimSpace(string(d))
	return b, nil
}

// gitArchive writes the files of HEAD into dst.
func gitArchive(root, dst string) error {
	cmd := exec.Command("git", "-C", root, "archive", "--format=tar", "HEAD")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	xerr := untar(stdout, dst, nil)
	_, _ = io.Copy(io.Discard, stdout)
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("git archive: %w: %s", err, stderr.String())
	}
	return xerr
}

// untar extracts a tar stream into dst. check, when set, sees every header first
// and may refuse it.
func untar(r io.Reader, dst string, check func(*tar.Header) error) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if check != nil {
			if err := check(h); err != nil {
				return err
			}
		}
		name := filepath.Clean(h.Name)
		if filepath.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("tar entry %q leaves the root", h.Name)
		}
		p := filepath.Join(dst, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return err
			}
			if err := os.Chmod(p, os.FileMode(h.Mode).Perm()|modeBits(h.Mode)); err != nil {
				return err
			}
		case tar.TypeReg:
			f, err := os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, os.FileMode(h.Mode).Perm())
			if err != nil {
				return err
			}
			if _, err := io.Copy(f, tr); err != nil {
				f.Close()
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
		case tar.TypeSymlink:
			if err := os.Symlink(h.Linkname, p); err != nil {
				return err
			}
		case tar.TypeXGlobalHeader:
		default:
			return fmt.Errorf("tar entry %q: unsupported type %q", h.Name, h.Typeflag)
		}
	}
}

func modeBits(m int64) os.FileMode {
	if m&0o1000 != 0 {
		return os.ModeSticky
	}
	return 0
}

// ociDescriptor, ociIndex, ociManifest and ociConfig are the parts of the OCI
// image spec the tests read.
type ociDescriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations"`
	Platform    *struct {
		OS           string `json:"os"`
		Architecture string `json:"architecture"`
		Variant      string `json:"variant"`
	} `json:"platform"`
}

type ociIndex struct {
	MediaType string          `json:"mediaType"`
	Manifests []ociDescriptor `json:"manifests"`
}

type ociManifest struct {
	MediaType string          `json:"mediaType"`
	Config    ociDescriptor   `json:"config"`
	Layers    []ociDescriptor `json:"layers"`
}

type ociConfig struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
	Config       struct {
		User       string   `json:"User"`
		Entrypoint []string `json:"Entrypoint"`
		Cmd        []string `json:"Cmd"`
		Env        []string `json:"Env"`
	} `json:"config"`
	RootFS struct {
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

// layout reads an OCI image layout, checking every blob against its digest.
type layout struct{ dir string }

func (l layout) blob(d ociDescriptor) ([]byte, error) {
	alg, hex, ok := strings.Cut(d.Digest, ":")
	if !ok || alg != "sha256" {
		return nil, fmt.Errorf("digest %q", d.Digest)
	}
	b, err := os.ReadFile(filepath.Join(l.dir, "blobs", alg, hex))
	if err != nil {
		return nil, err
	}
	if got := fmt.Sprintf("sha256:%x", sha256.Sum256(b)); got != d.Digest || int64(len(b)) != d.Size {
		return nil, fmt.Errorf("blob %s: content is %s, %d bytes (descriptor says %d)", d.Digest, got, len(b), d.Size)
	}
	return b, nil
}

func (l layout) json(d ociDescriptor, v any) error {
	b, err := l.blob(d)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// platformImage finds the image for arch in the layout's one index.
func (l layout) platformImage(arch string) (ociManifest, ociConfig, error) {
	var top, idx ociIndex
	var m ociManifest
	var c ociConfig
	b, err := os.ReadFile(filepath.Join(l.dir, "index.json"))
	if err != nil {
		return m, c, err
	}
	if err := json.Unmarshal(b, &top); err != nil {
		return m, c, err
	}
	if len(top.Manifests) != 1 {
		return m, c, fmt.Errorf("index.json has %d entries, want 1", len(top.Manifests))
	}
	if err := l.json(top.Manifests[0], &idx); err != nil {
		return m, c, err
	}
	for _, d := range idx.Manifests {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == arch {
			if err := l.json(d, &m); err != nil {
				return m, c, err
			}
			if err := l.json(m.Config, &c); err != nil {
				return m, c, err
			}
			return m, c, nil
		}
	}
	return m, c, fmt.Errorf("no linux/%s image in the index", arch)
}

// unpack extracts the image's layers in order into dst, checking each layer's
// uncompressed digest against the config's diff_ids and every entry against
// check.
func (l layout) unpack(m ociManifest, c ociConfig, dst string, check func(*tar.Header) error) error {
	if len(m.Layers) != len(c.RootFS.DiffIDs) {
		return fmt.Errorf("%d layers, %d diff_ids", len(m.Layers), len(c.RootFS.DiffIDs))
	}
	for i, d := range m.Layers {
		b, err := l.blob(d)
		if err != nil {
			return err
		}
		zr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return fmt.Errorf("layer %s: %w", d.Digest, err)
		}
		h := sha256.New()
		if err := untar(io.TeeReader(zr, h), dst, check); err != nil {
			return fmt.Errorf("layer %s: %w", d.Digest, err)
		}
		_, _ = io.Copy(h, zr) // tar padding after the end marker
		if got := fmt.Sprintf("sha256:%x", h.Sum(nil)); got != c.RootFS.DiffIDs[i] {
			return fmt.Errorf("layer %s: uncompressed digest %s, config says %s", d.Digest, got, c.RootFS.DiffIDs[i])
		}
	}
	return nil
}
