package agenttest

import (
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// Process is one started program.
type Process struct {
	Cmd *exec.Cmd
	Log *Log // its stdout and stderr

	group bool
	done  chan struct{} // closed when it has exited and err is set
	err   error
}

// Options say how Start runs a command.
type Options struct {
	// Log receives stdout and stderr; nil: a new Log. Several processes may
	// share one (a node's successive agents).
	Log *Log
	// Unmanaged registers no cleanup: the test stops the process itself (a
	// process it leaves dies with the test's cgroup). By default the test's
	// cleanup stops it (Stop with StopGrace) and, when the test failed, logs
	// the tail of its output.
	Unmanaged bool
	// Group signals the process group (the command was started with Setpgid,
	// as testenv.Command does) instead of the process.
	Group bool
}

// StopGrace is how long Stop waits after SIGTERM before it kills.
const StopGrace = 10 * time.Second

// Start starts cmd with its output in the Log and fails the test if it cannot.
func Start(t testing.TB, cmd *exec.Cmd, o Options) *Process {
	t.Helper()
	p := &Process{Cmd: cmd, Log: o.Log, group: o.Group, done: make(chan struct{})}
	if p.Log == nil {
		p.Log = &Log{}
	}
	cmd.Stdout, cmd.Stderr = p.Log, p.Log
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", cmd.Path, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	if !o.Unmanaged {
		t.Cleanup(func() {
			p.Stop(StopGrace)
			if t.Failed() {
				t.Logf("%s log (tail):\n%s", cmd.Path, p.Log.Tail(60))
			}
		})
	}
	return p
}

// Pid is the process id.
func (p *Process) Pid() int { return p.Cmd.Process.Pid }

// Signal sends sig to the process (or its group, Options.Group).
func (p *Process) Signal(sig syscall.Signal) error {
	if p.group {
		return syscall.Kill(-p.Pid(), sig)
	}
	return p.Cmd.Process.Signal(sig)
}

// SignalAndWait sends sig and waits up to d for the exit (Wait).
func (p *Process) SignalAndWait(sig syscall.Signal, d time.Duration) (exited bool, err error) {
	if err := p.Signal(sig); err != nil && !p.Exited() {
		return false, err
	}
	return p.Wait(d)
}

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Wait waits up to d for the process to exit and returns whether it did and
// its exit status.
func (p *Process) Wait(d time.Duration) (exited bool, err error) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
		return true, p.err
	case <-t.C:
		return false, nil
	}
}

// Stop sends SIGTERM, waits up to grace for the exit, then kills, and
// returns the exit status. It is a no-op on a process that has exited.
func (p *Process) Stop(grace time.Duration) error {
	if p.Exited() {
		return p.err
	}
	_ = p.Signal(syscall.SIGTERM)
	if ok, err := p.Wait(grace); ok {
		return err
	}
	p.Kill()
	return p.err
}

// Kill sends SIGKILL and waits for the exit.
func (p *Process) Kill() {
	_ = p.Signal(syscall.SIGKILL)
	<-p.done
}

// MustRun fails the test if the process has exited.
func (p *Process) MustRun(t testing.TB) {
	t.Helper()
	if p.Exited() {
		t.Fatalf("%s exited: %v\n%s", p.Cmd.Path, p.err, p.Log.Tail(40))
	}
}

// Command is name with args as a plain child of the test binary that the
// kernel kills when the test binary dies.
func Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = dieWithParent()
	return cmd
}
