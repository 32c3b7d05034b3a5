package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// KubeletWrite updates file in dir as kubelet updates a ConfigMap volume: a new
// timestamped directory (generation gen), a temporary symlink to it renamed
// over ..data atomically, and file as a symlink through ..data the first time.
func KubeletWrite(t testing.TB, dir, file, content string, gen int) {
	t.Helper()
	ts := filepath.Join(dir, fmt.Sprintf("..2026_01_01_00_00_%02d.%d", gen, gen))
	if err := os.Mkdir(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(ts, file), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, file)
	if _, err := os.Lstat(link); os.IsNotExist(err) {
		if err := os.Symlink(filepath.Join("..data", file), link); err != nil {
			t.Fatal(err)
		}
	}
}
