package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// runPush pushes the layout's index (every platform) to ref, with the
// credentials of the Docker config ($DOCKER_CONFIG or ~/.docker/config.json).
func runPush(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("image push", flag.ContinueOnError)
	dir := fs.String("layout", "out/image/oci", "OCI layout written by image build")
	ref := fs.String("ref", "", "destination, REGISTRY/REPOSITORY:TAG")
	insecure := fs.Bool("insecure", false, "allow a plain-HTTP registry")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *ref == "" {
		return fmt.Errorf("-ref is required (e.g. make image-push REGISTRY=registry.example.com/team)")
	}
	var opts []name.Option
	if *insecure {
		opts = append(opts, name.Insecure)
	}
	r, err := name.ParseReference(*ref, opts...)
	if err != nil {
		return fmt.Errorf("-ref %q: %w", *ref, err)
	}
	p, err := layout.FromPath(*dir)
	if err != nil {
		return fmt.Errorf("read layout %s (run make image first): %w", *dir, err)
	}
	top, err := p.ImageIndex()
	if err != nil {
		return err
	}
	m, err := top.IndexManifest()
	if err != nil {
		return err
	}
	if len(m.Manifests) != 1 {
		return fmt.Errorf("layout %s: want one image index in index.json, found %d entries", *dir, len(m.Manifests))
	}
	idx, err := top.ImageIndex(m.Manifests[0].Digest)
	if err != nil {
		return err
	}
	if err := remote.WriteIndex(r, idx, remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return fmt.Errorf("push %s: %w", r, err)
	}
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "pushed %s@%s\n", r.Context(), d)
	return nil
}
