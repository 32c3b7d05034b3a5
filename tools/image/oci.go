package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The image's fixed shape: where the binary goes, who it runs as by default.
const (
	binaryPath = "usr/local/bin/meshdns-ebpf"
	nonRootID  = 65532 // the conventional "nonroot" UID/GID of minimal images
)

// buildOptions are the inputs of one build: the same inputs give the same digest.
type buildOptions struct {
	Lock     string            // deploy/image/debs.lock
	Debs     string            // directory holding the locked .debs
	Binaries map[string]string // arch -> meshdns-ebpf binary for that arch
	Version  string            // org.opencontainers.image.version and the tag
	Revision string            // org.opencontainers.image.revision (commit), may be ""
	Epoch    time.Time         // every timestamp in the image
}

// archImage is one platform's image and what went into it.
type archImage struct {
	platform   platform
	img        v1.Image
	rootfsSize int64 // uncompressed bytes of regular files, both layers
	elfChecked int
}

// buildImage assembles one platform's image: a layer with the Debian files for
// the iptables fallback, and a layer with the agent binary.
func buildImage(o buildOptions, pf platform) (*archImage, error) {
	pkgs, err := readLock(o.Lock, pf.arch)
	if err != nil {
		return nil, err
	}
	base := fsTree{}
	for _, p := range pkgs {
		deb, err := readFileChecked(p, o.Debs)
		if err != nil {
			return nil, err
		}
		if err := base.addDeb(p.Name+"="+p.Version, deb, pf.triplet); err != nil {
			return nil, err
		}
	}
	if err := addImageFiles(base); err != nil {
		return nil, err
	}
	bin, err := os.ReadFile(o.Binaries[pf.arch])
	if err != nil {
		return nil, fmt.Errorf("agent binary for %s: %w", pf.arch, err)
	}
	app := fsTree{binaryPath: {mode: 0o755, data: bin, origin: "meshdns-ebpf"}}

	// The checks see the merged filesystem, as the container does.
	merged := fsTree{}
	for _, t := range []fsTree{base, app} {
		for n, f := range t {
			if err := merged.put(n, f); err != nil {
				return nil, err
			}
		}
	}
	if err := merged.checkLinks(); err != nil {
		return nil, fmt.Errorf("%s: %w", pf.arch, err)
	}
	checked, err := checkELF(merged, pf)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", pf.arch, err)
	}

	img, err := assemble(pf, o.Epoch, gzip.BestCompression, []layerSpec{
		{base, "Debian packages for the iptables fallback (deploy/image/debs.lock)"},
		{app, "meshdns-ebpf " + o.Version},
	}, v1.Config{
		Entrypoint: []string{"/" + binaryPath},
		Cmd:        []string{"run"},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		User:       fmt.Sprintf("%d:%d", nonRootID, nonRootID),
		WorkingDir: "/",
		Labels:     o.labels(),
	})
	if err != nil {
		return nil, err
	}
	img = mutate.Annotations(img, o.labels()).(v1.Image)
	return &archImage{platform: pf, img: img, rootfsSize: merged.size(), elfChecked: checked}, nil
}

// layerSpec is one layer of an image: its files and why it is there (history).
type layerSpec struct {
	t   fsTree
	why string
}

// assemble is an OCI image of one platform: the layers in order (gzip at
// level), every timestamp epoch, and cfg.
func assemble(pf platform, epoch time.Time, level int, layers []layerSpec, cfg v1.Config) (v1.Image, error) {
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	created := v1.Time{Time: epoch}
	for _, l := range layers {
		layer, err := tarLayerLevel(l.t, epoch, level)
		if err != nil {
			return nil, err
		}
		img, err = mutate.Append(img, mutate.Addendum{
			Layer:     layer,
			MediaType: types.OCILayer,
			History:   v1.History{Created: created, CreatedBy: l.why, Comment: "tools/image"},
		})
		if err != nil {
			return nil, err
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.Variant, cf.OS = pf.arch, pf.variant, "linux"
	cf.Created = created
	cf.Config = cfg
	return mutate.ConfigFile(img, cf)
}

func (o buildOptions) labels() map[string]string {
	l := map[string]string{
		"org.opencontainers.image.title":       "meshdns-ebpf",
		"org.opencontainers.image.description": "Node DNS for Kubernetes and service meshes, captured at the socket with eBPF",
		"org.opencontainers.image.version":     o.Version,
		"org.opencontainers.image.created":     o.Epoch.UTC().Format(time.RFC3339),
	}
	if o.Revision != "" {
		l["org.opencontainers.image.revision"] = o.Revision
	}
	return l
}

// addImageFiles adds what the packages' maintainer scripts would have made and
// what a container needs: the iptables alternatives (Debian's default, nft),
// users for the numeric IDs, and the usual top-level directories.
func addImageFiles(t fsTree) error {
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, tool := range []string{"", "-save", "-restore"} {
			target := fam + "-nft" + tool
			if _, ok := t["usr/sbin/"+target]; !ok {
				return fmt.Errorf("usr/sbin/%s is not in the iptables package", target)
			}
			if err := t.put("usr/sbin/"+fam+tool, &file{mode: 0o777, link: target, origin: "image"}); err != nil {
				return err
			}
		}
	}
	extra := map[string]*file{
		"etc/passwd":   {mode: 0o644, data: []byte(fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", nonRootID, nonRootID))},
		"etc/group":    {mode: 0o644, data: []byte(fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", nonRootID))},
		"home/nonroot": {dir: true, mode: 0o755},
		"tmp":          {dir: true, mode: 0o1777},
		"run":          {dir: true, mode: 0o755},
		"proc":         {dir: true, mode: 0o555},
		"sys":          {dir: true, mode: 0o555},
		"dev":          {dir: true, mode: 0o755},
	}
	for n, f := range extra {
		f.origin = "image"
		if err := t.put(n, f); err != nil {
			return err
		}
	}
	return nil
}

// tarLayerLevel is a gzip-compressed OCI layer of t. gzip with a fixed level and
// no header timestamp is deterministic for a given Go release.
func tarLayerLevel(t fsTree, mtime time.Time, level int) (v1.Layer, error) {
	var buf bytes.Buffer
	if err := t.writeTar(&buf, mtime); err != nil {
		return nil, err
	}
	raw := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(raw)), nil
	}, tarball.WithCompressionLevel(level), tarball.WithMediaType(types.OCILayer))
}

// buildIndex makes the multi-platform index of the images, in the order given.
func buildIndex(imgs []*archImage, o buildOptions) v1.ImageIndex {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, ai := range imgs {
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add: ai.img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{
				OS: "linux", Architecture: ai.platform.arch, Variant: ai.platform.variant,
			}},
		})
	}
	return mutate.Annotations(idx, o.labels()).(v1.ImageIndex)
}

// writeLayout writes idx as an OCI image layout in dir (replacing it), with one
// entry in index.json named by the tag (org.opencontainers.image.ref.name) and,
// for containerd's import, by the full local name.
func writeLayout(dir string, idx v1.ImageIndex, name, tag string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("write OCI layout: %w", err)
	}
	return p.AppendIndex(idx, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": tag,
		"io.containerd.image.name":          name + ":" + tag,
	}))
}

// writeArchive packs the layout directory into a tar (an "OCI archive", what
// `ctr images import`, `skopeo copy oci-archive:` and `podman load` read), with
// sorted entries, fixed modes and one timestamp.
func writeArchive(dir, out string, mtime time.Time) error {
	var names []string
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		names = append(names, filepath.ToSlash(rel))
		return nil
	})
	if err != nil {
		return err
	}
	sort.Strings(names)
	f, err := os.Create(out + ".tmp")
	if err != nil {
		return err
	}
	defer os.Remove(out + ".tmp")
	tw := tar.NewWriter(f)
	for _, n := range names {
		fi, err := os.Stat(filepath.Join(dir, n))
		if err != nil {
			return err
		}
		h := &tar.Header{Name: n, Mode: 0o644, ModTime: mtime, Typeflag: tar.TypeReg, Size: fi.Size()}
		if fi.IsDir() {
			h.Name, h.Mode, h.Typeflag, h.Size = n+"/", 0o755, tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.IsDir() {
			b, err := os.ReadFile(filepath.Join(dir, n))
			if err != nil {
				return err
			}
			if _, err := tw.Write(b); err != nil {
				return err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(out+".tmp", out)
}
