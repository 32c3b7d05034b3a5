package node

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The images of the node test, all built here without a container engine:
// the agent by `make image` (the image users install), the rest by
// `image bundle` (tools/image) from binaries of this machine's Debian packages
// and from programs built here.
const (
	agentRepo  = "localhost/meshdns-ebpf"
	agentTag   = "nodetest-a" // installed
	agentTag2  = "nodetest-b" // the image change of a rollout: the same image under a second tag
	pauseImage = "localhost/nodetest-pause:v1"
	glibcImage = "localhost/nodetest-glibc:v1"
	muslImage  = "localhost/nodetest-musl:v1"
	goImage    = "localhost/nodetest-go:v1"
)

// images are the OCI archives to import, and what building them cost.
type images struct {
	archives []string
	took     time.Duration
}

// buildImages builds every image into dir.
func buildImages(t *testing.T, root, dir string) images {
	t.Helper()
	start := time.Now()
	bin := filepath.Join(dir, "bin")
	tool := filepath.Join(dir, "image-tool")
	run := func(wd string, env []string, name string, args ...string) {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir = wd
		cmd.Env = append(os.Environ(), env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
	}
	static := []string{"CGO_ENABLED=0"}
	for _, p := range []struct{ out, pkg string }{
		{"pause", "./test/node/testdata/pause"},
		{"markerdns", "./test/node/testdata/markerdns"},
		{"goload", "./test/e2e/testdata/goload"},
		{"goresolve", "./test/e2e/testdata/goresolve"},
	} {
		run(root, static, "go", "build", "-trimpath", "-o", filepath.Join(bin, p.out), p.pkg)
	}
	run(root, nil, "gcc", "-O2", "-pthread", "-o", filepath.Join(bin, "dnsload-glibc"), "test/e2e/testdata/dnsload/dnsload.c")
	run(root, nil, "musl-gcc", "-static", "-O2", "-pthread", "-o", filepath.Join(bin, "dnsload-musl"), "test/e2e/testdata/dnsload/dnsload.c")
	run(root, nil, "musl-gcc", "-static", "-O2", "-o", filepath.Join(bin, "muslresolve"), "test/e2e/testdata/muslresolve.c")
	run(root, nil, "musl-gcc", "-static", "-O2", "-o", filepath.Join(bin, "egressload-musl"), "test/e2e/testdata/egressload/egressload.c")
	run(filepath.Join(root, "tools", "image"), static, "go", "build", "-trimpath", "-o", tool, ".")

	var im images
	// The agent's image, exactly as users build it.
	agentOut := filepath.Join(dir, "agent")
	run(root, []string{"MAKEFLAGS=", "MAKELEVEL="}, "make", "image", "IMAGE_OUT="+agentOut, "IMAGE_TAG="+agentTag)
	im.archives = append(im.archives, filepath.Join(agentOut, "meshdns-ebpf.oci.tar"))

	pause := "/pause=" + filepath.Join(bin, "pause")
	for _, b := range []struct {
		ref  string
		args []string
	}{
		{pauseImage, []string{"-file", pause, "-entrypoint", "/pause"}},
		{glibcImage, []string{"-file", pause, "-host", "/usr/bin/getent", "-host", "/usr/bin/dig",
			"-file", "/usr/local/bin/dnsload=" + filepath.Join(bin, "dnsload-glibc"),
			"-text", "etc/nsswitch.conf=hosts: files dns"}},
		{muslImage, []string{"-file", pause, "-file", "/usr/local/bin/dnsload=" + filepath.Join(bin, "dnsload-musl"),
			"-file", "/usr/local/bin/muslresolve=" + filepath.Join(bin, "muslresolve"),
			"-file", "/usr/local/bin/egressload=" + filepath.Join(bin, "egressload-musl")}},
		{goImage, []string{"-file", pause, "-file", "/usr/local/bin/goload=" + filepath.Join(bin, "goload"),
			"-file", "/usr/local/bin/goresolve=" + filepath.Join(bin, "goresolve"),
			"-file", "/usr/local/bin/markerdns=" + filepath.Join(bin, "markerdns")}},
	} {
		name, tag, _ := strings.Cut(b.ref, ":")
		out := filepath.Join(dir, filepath.Base(name))
		run(root, nil, tool, append([]string{"bundle", "-name", name, "-tag", tag, "-out", out}, b.args...)...)
		im.archives = append(im.archives, filepath.Join(out, "image.oci.tar"))
	}
	im.took = time.Since(start)
	return im
}

func (im images) String() string {
	return fmt.Sprintf("%d images built in %v", len(im.archives), im.took.Round(time.Millisecond))
}
