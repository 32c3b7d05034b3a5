package testenv

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// CopyExecutable copies the running test binary to dir/client and makes dir
// and the copy usable by any UID (a test binary under the build cache is
// not), for tests that re-run themselves as another user's client. The caller
// removes dir.
func CopyExecutable(dir string) (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("find the test binary: %w", err)
	}
	src, err := os.Open(self)
	if err != nil {
		return "", fmt.Errorf("open the test binary: %w", err)
	}
	defer src.Close()
	dst := filepath.Join(dir, "client")
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		return "", fmt.Errorf("create %s: %w", dst, err)
	}
	if _, err := io.Copy(out, src); err != nil {
		out.Close()
		return "", fmt.Errorf("copy the test binary to %s: %w", dst, err)
	}
	if err := out.Close(); err != nil {
		return "", fmt.Errorf("close %s: %w", dst, err)
	}
	return dst, os.Chmod(dir, 0o755)
}

// RunWithCopy is a TestMain's body for tests that re-run their binary as
// another user's client: it copies the binary (CopyExecutable) into a fresh
// directory named by prefix, sets *bin to the copy, runs the tests and removes
// the directory. It returns the exit code for os.Exit.
func RunWithCopy(m *testing.M, prefix string, bin *string) int {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	if *bin, err = CopyExecutable(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}
