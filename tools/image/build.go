package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/partial"
)

func runBuild(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("image build", flag.ContinueOnError)
	var o buildOptions
	var bins, out, name string
	var epoch int64
	fs.StringVar(&o.Lock, "lock", "deploy/image/debs.lock", "lock file of the Debian packages")
	fs.StringVar(&o.Debs, "debs", ".cache/image/debs", "directory with the locked .deb files")
	fs.StringVar(&bins, "bin", "", "ARCH=PATH of the agent binary per architecture, comma-separated (amd64, arm64)")
	fs.StringVar(&o.Version, "version", "dev", "version label and tag")
	fs.StringVar(&o.Revision, "revision", "", "source revision label")
	fs.Int64Var(&epoch, "epoch", 0, "timestamp of every file and of the image, in seconds (SOURCE_DATE_EPOCH)")
	fs.StringVar(&out, "out", "out/image", "output directory: oci/ (OCI layout), meshdns-ebpf.oci.tar, digest")
	fs.StringVar(&name, "name", "localhost/meshdns-ebpf", "image name recorded for containerd's import")
	if err := fs.Parse(args); err != nil {
		return err
	}
	o.Epoch = time.Unix(epoch, 0).UTC()
	o.Binaries = map[string]string{}
	for _, kv := range strings.Split(bins, ",") {
		arch, p, ok := strings.Cut(kv, "=")
		if !ok {
			return fmt.Errorf("-bin %q: want ARCH=PATH", kv)
		}
		if _, known := platforms[arch]; !known {
			return fmt.Errorf("-bin: unknown architecture %q (amd64, arm64)", arch)
		}
		o.Binaries[arch] = p
	}
	arches := make([]string, 0, len(o.Binaries))
	for a := range o.Binaries {
		arches = append(arches, a)
	}
	sort.Strings(arches)

	var imgs []*archImage
	for _, a := range arches {
		ai, err := buildImage(o, platforms[a])
		if err != nil {
			return err
		}
		imgs = append(imgs, ai)
	}
	idx := buildIndex(imgs, o)
	if err := writeLayout(filepath.Join(out, "oci"), idx, name, o.Version); err != nil {
		return err
	}
	archive := filepath.Join(out, "meshdns-ebpf.oci.tar")
	if err := writeArchive(filepath.Join(out, "oci"), archive, o.Epoch); err != nil {
		return fmt.Errorf("write %s: %w", archive, err)
	}
	digest, err := idx.Digest()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "digest"), []byte(digest.String()+"\n"), 0o644); err != nil {
		return err
	}

	fmt.Fprintf(stdout, "%-8s %-10s %-12s %-12s %s\n", "ARCH", "LAYERS", "COMPRESSED", "UNPACKED", "MANIFEST")
	for _, ai := range imgs {
		layers, err := ai.img.Layers()
		if err != nil {
			return err
		}
		var compressed int64
		for _, l := range layers {
			s, err := l.Size()
			if err != nil {
				return err
			}
			compressed += s
		}
		d, err := partial.Digest(ai.img)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%-8s %-10d %-12s %-12s %s\n", ai.platform.arch, len(layers), mib(compressed), mib(ai.rootfsSize), d)
	}
	fmt.Fprintf(stdout, "index %s (%s:%s)\n", digest, name, o.Version)
	fmt.Fprintf(stdout, "wrote %s and %s\n", filepath.Join(out, "oci"), archive)
	return nil
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
