package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"fmt"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// fakeDeb builds a .deb (ar: debian-binary, control.tar.gz, data.tar.gz) holding files.
func fakeDeb(t *testing.T, files map[string]string, links map[string]string) []byte {
	t.Helper()
	var data bytes.Buffer
	zw := gzip.NewWriter(&data)
	tw := tar.NewWriter(zw)
	tw.WriteHeader(&tar.Header{Name: "./usr/", Typeflag: tar.TypeDir, Mode: 0o755})
	for n, c := range files {
		tw.WriteHeader(&tar.Header{Name: "./" + n, Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(c)), ModTime: time.Now()})
		tw.Write([]byte(c))
	}
	for n, target := range links {
		tw.WriteHeader(&tar.Header{Name: "./" + n, Typeflag: tar.TypeSymlink, Linkname: target, ModTime: time.Now()})
	}
	tw.Close()
	zw.Close()
	var ar bytes.Buffer
	ar.WriteString("!<arch>\n")
	member := func(name string, body []byte) {
		fmt.Fprintf(&ar, "%-16s%-12d%-6d%-6d%-8o%-10d`\n", name, 0, 0, 0, 0o644, len(body))
		ar.Write(body)
		if len(body)%2 == 1 {
			ar.WriteByte('\n')
		}
	}
	member("debian-binary", []byte("2.0\n"))
	member("control.tar.gz", []byte("x")) // odd size: exercises the padding
	member("data.tar.gz", data.Bytes())
	return ar.Bytes()
}

func TestDebToDeterministicLayer(t *testing.T) {
	files := map[string]string{"usr/sbin/tool": "binary", "usr/share/doc/pkg/copyright": "text", "usr/lib/x86_64-linux-gnu/gconv/X.so": "x"}
	links := map[string]string{"usr/sbin/tool-alias": "tool"}
	var tars [2][]byte
	for i := range tars {
		tr := fsTree{}
		if err := tr.addDeb("pkg", fakeDeb(t, files, links), "x86_64-linux-gnu"); err != nil {
			t.Fatal(err)
		}
		if _, ok := tr["usr/share/doc/pkg/copyright"]; ok {
			t.Error("documentation was not excluded")
		}
		if _, ok := tr["usr/lib/x86_64-linux-gnu/gconv/X.so"]; ok {
			t.Error("gconv was not excluded")
		}
		if err := tr.checkLinks(); err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if err := tr.writeTar(&buf, time.Unix(1700000000, 0)); err != nil {
			t.Fatal(err)
		}
		tars[i] = buf.Bytes()
		time.Sleep(1100 * time.Millisecond) // the .deb's own timestamps change; the layer must not
	}
	if !bytes.Equal(tars[0], tars[1]) {
		t.Fatal("the same files gave two different layers")
	}
	var names []string
	rd := tar.NewReader(bytes.NewReader(tars[0]))
	for {
		h, err := rd.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
		if h.ModTime.Unix() != 1700000000 || h.Uid != 0 || h.Gid != 0 {
			t.Errorf("%s: mtime %v owner %d:%d", h.Name, h.ModTime, h.Uid, h.Gid)
		}
	}
	if got, want := strings.Join(names, " "), "usr/ usr/sbin/ usr/sbin/tool usr/sbin/tool-alias"; got != want {
		t.Errorf("entries %q, want %q (sorted, with parent directories)", got, want)
	}
}

func TestDanglingLinkAndConflict(t *testing.T) {
	tr := fsTree{}
	if err := tr.addDeb("a", fakeDeb(t, nil, map[string]string{"usr/bin/x": "/usr/share/doc/gone"}), "x86_64-linux-gnu"); err != nil {
		t.Fatal(err)
	}
	if err := tr.checkLinks(); err == nil || !strings.Contains(err.Error(), "usr/bin/x") {
		t.Errorf("dangling link not reported: %v", err)
	}
	if err := tr.addDeb("b", fakeDeb(t, map[string]string{"usr/bin/x": "file"}, nil), "x86_64-linux-gnu"); err == nil {
		t.Error("two packages supplying one path differently was accepted")
	}
}

// checkELF must find a missing library: this test binary's own libraries are not
// in an empty tree (a static test binary has none, then nothing is needed).
func TestELFCheckFindsMissingLibraries(t *testing.T) {
	self, err := os.ReadFile("/bin/true")
	if err != nil {
		t.Skip("no /bin/true to take a dynamically linked ELF from")
	}
	pf, ok := map[string]platform{"amd64": platforms["amd64"], "arm64": platforms["arm64"]}[goarch()]
	if !ok {
		t.Skip("unknown architecture")
	}
	tr := fsTree{"usr/bin/true": {mode: 0o755, data: self}}
	_, err = checkELF(tr, pf)
	if err == nil || !strings.Contains(err.Error(), "libc.so.6") || !strings.Contains(err.Error(), "program interpreter") {
		t.Fatalf("missing libc and loader not reported: %v", err)
	}
	other := platforms["arm64"]
	if pf.arch == "arm64" {
		other = platforms["amd64"]
	}
	if _, err := checkELF(tr, other); err == nil || !strings.Contains(err.Error(), "built for") {
		t.Fatalf("wrong machine not reported: %v", err)
	}
}

// A layout built from a fake package and binary pushes to a registry (an
// in-process one here) under the same digest.
func TestBuildAndPush(t *testing.T) {
	dir := t.TempDir()
	debs := filepath.Join(dir, "debs")
	os.MkdirAll(debs, 0o755)
	deb := fakeDeb(t, map[string]string{
		"usr/sbin/xtables-nft-multi": "#!multi",
	}, map[string]string{
		"usr/sbin/iptables-nft": "xtables-nft-multi", "usr/sbin/iptables-nft-save": "xtables-nft-multi",
		"usr/sbin/iptables-nft-restore": "xtables-nft-multi", "usr/sbin/ip6tables-nft": "xtables-nft-multi",
		"usr/sbin/ip6tables-nft-save": "xtables-nft-multi", "usr/sbin/ip6tables-nft-restore": "xtables-nft-multi",
	})
	os.WriteFile(filepath.Join(debs, "iptables_1_amd64.deb"), deb, 0o644)
	lock := filepath.Join(dir, "lock")
	os.WriteFile(lock, []byte(fmt.Sprintf("iptables 1 amd64 %x %d pool/main/i/iptables/iptables_1_amd64.deb\n", sha256.Sum256(deb), len(deb))), 0o644)
	bin := filepath.Join(dir, "agent")
	os.WriteFile(bin, []byte("agent"), 0o755)

	var out bytes.Buffer
	args := []string{"build", "-lock", lock, "-debs", debs, "-bin", "amd64=" + bin, "-version", "t1", "-epoch", "1700000000", "-out", filepath.Join(dir, "out")}
	if err := run(args, &out); err != nil {
		t.Fatal(err)
	}
	digest, _ := os.ReadFile(filepath.Join(dir, "out", "digest"))
	if err := run(append(args[:len(args)-1], filepath.Join(dir, "out2")), &out); err != nil {
		t.Fatal(err)
	}
	digest2, _ := os.ReadFile(filepath.Join(dir, "out2", "digest"))
	if string(digest) != string(digest2) || len(digest) < 10 {
		t.Fatalf("two builds: %q and %q", digest, digest2)
	}

	srv := httptest.NewServer(registry.New())
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	ref := u.Host + "/team/meshdns-ebpf:t1"
	if err := run([]string{"push", "-layout", filepath.Join(dir, "out", "oci"), "-ref", ref, "-insecure"}, &out); err != nil {
		t.Fatal(err)
	}
	r, _ := name.ParseReference(ref, name.Insecure)
	desc, err := remote.Get(r)
	if err != nil {
		t.Fatal(err)
	}
	if got := desc.Digest.String(); got != strings.TrimSpace(string(digest)) {
		t.Fatalf("registry has %s, layout digest %s", got, digest)
	}
	if !desc.MediaType.IsIndex() {
		t.Errorf("pushed %s, want an index", desc.MediaType)
	}
}

func goarch() string { return runtime.GOARCH }
