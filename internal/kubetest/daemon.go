package kubetest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Daemon is a long-running child of the test started beside a control plane (the
// test node's containerd, kubelet, kube-scheduler, kube-proxy): through
// Options.Wrap, into Options.Cgroup, with Pdeathsig, its output in a log file of
// the control plane's directory. It is killed at cleanup, before the control
// plane, and its log tail is printed when the test failed.
type Daemon struct {
	p *process
}

// StartDaemon starts path with args and polls ready every 20 ms until it
// returns nil (or the daemon exits, or timeout passes: the test fails). It
// returns how long the daemon took to be ready.
func (cp *ControlPlane) StartDaemon(t testing.TB, name, path string, args []string, timeout time.Duration, ready func() error) (*Daemon, time.Duration) {
	t.Helper()
	p := &process{name: name, path: path, logPath: filepath.Join(cp.dir, name+".log"), wrap: cp.opts.Wrap, cgroup: cp.opts.Cgroup}
	d := &Daemon{p: p}
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("kubetest: last lines of %s (%s):\n%s", name, p.logPath, p.tail(40))
		}
	})
	if err := p.start(args); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	took, err := p.waitReady(timeout, ready)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	return d, took
}

// PID is the daemon's process id (0 once stopped).
func (d *Daemon) PID() int { return d.p.pid() }

// Stop kills the daemon (SIGKILL) and waits for it.
func (d *Daemon) Stop() { d.p.stop() }

// Tail is the last n lines of its log.
func (d *Daemon) Tail(n int) string { return d.p.tail(n) }

// LogPath is its log file.
func (d *Daemon) LogPath() string { return d.p.logPath }

// Log is its whole log so far.
func (d *Daemon) Log() string {
	b, err := os.ReadFile(d.p.logPath)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
}
