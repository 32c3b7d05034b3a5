package kubetest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// process is one child of the test binary: etcd, kube-apiserver or
// kube-controller-manager. Its stdout and stderr go to a log file that survives
// restarts (each start appends a header), so a failed test can print its tail.
type process struct {
	name    string
	path    string
	logPath string
	env     []string // added to the test binary's environment
	wrap    []string // put before path (Options.Wrap)
	cgroup  string   // cgroup2 directory it starts in (Options.Cgroup), "" for the test's own

	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{} // closed when the current cmd has been waited for
	err    error         // its exit status
	logOff int64         // where the current run's output starts in the log
	begun  time.Time     // when the current run started
}

// start launches the process with args. Every child gets Pdeathsig SIGKILL so a
// crashed or killed test binary leaves nothing running.
func (p *process) start(args []string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		select {
		case <-p.done: // it exited on its own: start it again
		default:
			return fmt.Errorf("%s is already running (pid %d)", p.name, p.cmd.Process.Pid)
		}
	}
	f, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open %s log: %w", p.name, err)
	}
	if st, err := f.Stat(); err == nil {
		p.logOff = st.Size()
	}
	fmt.Fprintf(f, "=== kubetest: %s start %s\n%s %s\n", p.name, time.Now().Format(time.RFC3339Nano), p.path, strings.Join(args, " "))
	argv := append(append(append([]string{}, p.wrap...), p.path), args...)
	cmd := exec.Command(argv[0], argv[1:]...)
	if len(p.env) > 0 {
		cmd.Env = append(os.Environ(), p.env...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = dieWithParent()
	if p.cgroup != "" {
		cg, err := os.Open(p.cgroup)
		if err != nil {
			f.Close()
			return fmt.Errorf("start %s: open its cgroup: %w", p.name, err)
		}
		defer cg.Close()
		intoCgroup(cmd.SysProcAttr, int(cg.Fd()))
	}
	if err := spawn(cmd); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	done := make(chan struct{})
	p.cmd, p.done, p.begun = cmd, done, time.Now()
	go func() {
		err := cmd.Wait()
		f.Close()
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(done)
	}()
	return nil
}

// pid is the running process's id (0 when not running).
func (p *process) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// sinceStart is the time since the current (or last) run started.
func (p *process) sinceStart() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return time.Since(p.begun)
}

// exited returns a channel closed when the running process exits (nil: not started).
func (p *process) exited() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// exitErr is the exit status of the last run; valid once exited() is closed.
func (p *process) exitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// stop kills the process with SIGKILL and waits for it. A no-op when not running.
func (p *process) stop() {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// tail returns the last n lines of the process's log.
func (p *process) tail(n int) string {
	f, err := os.Open(p.logPath)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 2*n {
			lines = append(lines[:0], lines[len(lines)-n:]...)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// logContains reports whether the current run's log has s in it (e.g. "address
// already in use").
func (p *process) logContains(s string) bool {
	b, err := os.ReadFile(p.logPath)
	p.mu.Lock()
	off := p.logOff
	p.mu.Unlock()
	return err == nil && off <= int64(len(b)) && strings.Contains(string(b[off:]), s)
}

// spawnReq asks the spawner thread to start one command.
type spawnReq struct {
	cmd *exec.Cmd
	err chan error
}

var (
	spawnOnce sync.Once
	spawnCh   chan spawnReq
)

// spawn starts cmd from one OS thread that lives as long as the test binary.
// Pdeathsig fires when the thread that forked the child exits, not the process; Go
// ends a thread when a goroutine locked to it (netns tests) returns without
// unlocking, and that would SIGKILL a control plane started from it mid-test. A
// goroutine locked to its thread forever keeps that thread alive.
func spawn(cmd *exec.Cmd) error {
	spawnOnce.Do(func() {
		spawnCh = make(chan spawnReq)
		go func() {
			runtime.LockOSThread()
			for req := range spawnCh {
				req.err <- req.cmd.Start()
			}
		}()
	})
	req := spawnReq{cmd: cmd, err: make(chan error, 1)}
	spawnCh <- req
	return <-req.err
}

// freePorts returns n distinct TCP ports on 127.0.0.1 that were free a moment ago.
// The children bind them shortly after; startRetrying covers the rare race.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("pick a free port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// waitReady polls ready every 20 ms until it returns nil, the process exits, or
// timeout passes. It returns how long it took.
func (p *process) waitReady(timeout time.Duration, ready func() error) (time.Duration, error) {
	start := time.Now()
	exited := p.exited()
	var last error
	gone := false
	testenv.Poll(timeout, 20*time.Millisecond, func() bool {
		if last = ready(); last == nil {
			return true
		}
		select {
		case <-exited:
			gone = true
			return true
		default:
			return false
		}
	})
	switch {
	case last == nil:
		return time.Since(start), nil
	case gone:
		return time.Since(start), fmt.Errorf("%s exited before it was ready (%v); log tail:\n%s", p.name, p.exitErr(), p.tail(30))
	}
	return time.Since(start), fmt.Errorf("%s not ready after %v: %v; log tail:\n%s", p.name, timeout, last, p.tail(30))
}

// startRetrying starts p with args built from fresh free ports and waits for it to
// be ready, retrying with other ports when a port was taken in between.
func (p *process) startRetrying(t testing.TB, nports int, timeout time.Duration,
	args func(ports []int) []string, ready func(ports []int) error) ([]int, time.Duration) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(nports)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.start(args(ports)); err != nil {
			t.Fatal(err)
		}
		took, err := p.waitReady(timeout, func() error { return ready(ports) })
		if err == nil {
			return ports, took
		}
		p.stop()
		if attempt < 3 && p.logContains("address already in use") {
			t.Logf("kubetest: %s: a port was taken, retrying with others", p.name)
			continue
		}
		t.Fatal(err)
	}
}
