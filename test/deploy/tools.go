package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// ToolsBinEnv names the directory scripts/build-tools.sh builds helm, promtool and
// promql-metrics into (default <repo>/.cache/tools-bin).
const ToolsBinEnv = "MESHDNS_TOOLS_BIN"

// tool is the path of a binary scripts/build-tools.sh builds; without it the test
// skips (fails under CI=true).
func tool(t *testing.T, name string) string {
	t.Helper()
	dir := os.Getenv(ToolsBinEnv)
	if dir == "" {
		dir = filepath.Join(repoRoot(), ".cache", "tools-bin")
	}
	p := filepath.Join(dir, name)
	if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
		testenv.Skip(t, "%s is not built in %s: run `make tools-bin` (scripts/build-tools.sh), or set %s", name, dir, ToolsBinEnv)
	}
	return p
}

// runTool runs a tool and returns its stdout; stderr goes into the failure.
func runTool(t *testing.T, stdin []byte, name string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(tool(t, name), args...)
	cmd.Dir = repoRoot()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), &toolError{err: err, stderr: stderr.String(), stdout: stdout.String()}
	}
	return stdout.Bytes(), nil
}

type toolError struct {
	err            error
	stderr, stdout string
}

func (e *toolError) Error() string {
	return e.err.Error() + "\nstdout:\n" + e.stdout + "\nstderr:\n" + e.stderr
}
