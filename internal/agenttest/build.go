package agenttest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// Out stands for the output path in a Program build command.
const Out = "{out}"

// built holds the programs built by this test binary, by name.
var built struct {
	mu    sync.Mutex
	dir   string
	progs map[string]*program
}

type program struct {
	once sync.Once
	path string
	err  error
}

// root is the module's root directory.
func root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// Agent is the meshdns-ebpf binary (./cmd/meshdns-ebpf), built once per test
// binary.
func Agent(t testing.TB) string {
	t.Helper()
	return GoBinary(t, "./cmd/meshdns-ebpf")
}

// GoBinary builds the main package pkg (a path relative to the module root,
// CGO_ENABLED=0) once per test binary and returns the binary's path.
func GoBinary(t testing.TB, pkg string) string {
	t.Helper()
	return Program(t, filepath.Base(pkg), "go", "build", "-o", Out, pkg)
}

// Program runs the build command argv (in the module root, CGO_ENABLED=0 in
// its environment, Out replaced by the output path) the first time a test of
// this binary asks for name, and returns the built program's path. A failed
// build fails every test that asks for it. The directory is readable by every
// user (clients run as unprivileged uids); RemoveBinaries removes it.
func Program(t testing.TB, name string, argv ...string) string {
	t.Helper()
	built.mu.Lock()
	if built.progs == nil {
		built.progs = map[string]*program{}
	}
	p := built.progs[name]
	if p == nil {
		p = &program{}
		built.progs[name] = p
	}
	built.mu.Unlock()
	p.once.Do(func() { p.path, p.err = build(name, argv) })
	if p.err != nil {
		t.Fatalf("build %s: %v", name, p.err)
	}
	return p.path
}

func build(name string, argv []string) (string, error) {
	dir, err := binDir()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, name)
	args := make([]string, len(argv))
	for i, a := range argv {
		args[i] = strings.ReplaceAll(a, Out, out)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = root()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s: %v\n%s", strings.Join(args, " "), err, b)
	}
	return out, nil
}

func binDir() (string, error) {
	built.mu.Lock()
	defer built.mu.Unlock()
	if built.dir != "" {
		return built.dir, nil
	}
	dir, err := os.MkdirTemp("", "meshdns-test-bin-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	built.dir = dir
	return dir, nil
}

// RemoveBinaries removes what Program built. Call it from TestMain after m.Run.
func RemoveBinaries() {
	built.mu.Lock()
	defer built.mu.Unlock()
	if built.dir != "" {
		os.RemoveAll(built.dir)
		built.dir = ""
	}
}
