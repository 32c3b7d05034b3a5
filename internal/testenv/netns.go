//go:build linux

package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Netns is a named network namespace (ip netns) created for one test, with its
// loopback up. Processes started through Command see /etc/netns/<name>/resolv.conf
// as their /etc/resolv.conf.
type Netns struct {
	Name string
}

// NewNetns creates a network namespace named prefix-<random> and deletes it (and its
// /etc/netns entry) at cleanup.
func NewNetns(t testing.TB, prefix string) *Netns {
	t.Helper()
	sweepNetnsOnce.Do(func() { sweepStaleNetns(t) })
	n := &Netns{Name: OwnedName(prefix, 6)}
	Run(t, "ip", "netns", "add", n.Name)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
			t.Errorf("delete netns %s: %v: %s", n.Name, err, out)
		}
		removeEtcNetns(t, n.Name)
	})
	n.IP(t, "link", "set", "lo", "up")
	return n
}

// IP runs `ip -n <netns> args...`.
func (n *Netns) IP(t testing.TB, args ...string) string {
	t.Helper()
	return Run(t, "ip", append([]string{"-n", n.Name}, args...)...)
}

// Exec runs a command inside the namespace (as root, in the caller's cgroup).
func (n *Netns) Exec(t testing.TB, name string, args ...string) string {
	t.Helper()
	return Run(t, "ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
}

// SetResolvConf writes the resolv.conf that processes started in this namespace see.
func (n *Netns) SetResolvConf(t testing.TB, content string) {
	t.Helper()
	dir := filepath.Join("/etc/netns", n.Name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("create %s: %v", dir, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "resolv.conf"), []byte(content), 0o644); err != nil {
		t.Fatalf("write resolv.conf for %s: %v", n.Name, err)
	}
}

var sweepNetnsOnce sync.Once

// sweepStaleNetns removes the namespaces (and their /etc/netns entries) that test
// processes killed before their cleanup left behind.
func sweepStaleNetns(t testing.TB) {
	entries, _ := os.ReadDir("/run/netns")
	for _, e := range entries {
		if !StaleOwner(e.Name()) {
			continue
		}
		if out, err := exec.Command("ip", "netns", "del", e.Name()).CombinedOutput(); err != nil {
			t.Logf("remove stale netns %s: %v: %s", e.Name(), err, out)
			continue
		}
		removeEtcNetns(t, e.Name())
		t.Logf("removed netns %s, left by a test process that is gone", e.Name())
	}
}

// removeEtcNetns removes /etc/netns/<name>, and /etc/netns itself when it is left empty
// (the host had none before the tests).
func removeEtcNetns(t testing.TB, name string) {
	if err := os.RemoveAll(filepath.Join("/etc/netns", name)); err != nil {
		t.Errorf("remove /etc/netns/%s: %v", name, err)
	}
	_ = os.Remove("/etc/netns") // fails while other tests' entries remain: that is fine
}

// Path is the bind-mounted namespace file.
func (n *Netns) Path() string { return filepath.Join("/var/run/netns", n.Name) }

// HTTPClient is an HTTP client whose connections are dialled inside the
// namespace (each dial 2 s at most), for an endpoint listening there. The
// caller closes its idle connections (CloseIdleConnections) when done.
func (n *Netns) HTTPClient(timeout time.Duration) *http.Client {
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		var c net.Conn
		err := n.Do(func() (err error) {
			c, err = (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}}
	return &http.Client{Transport: tr, Timeout: timeout}
}

// Do runs fn on an OS thread switched into the namespace, so sockets fn opens
// (listeners, dialers) live in it. The thread is switched back afterwards.
func (n *Netns) Do(fn func() error) error {
	return DoInNetns(n.Path(), fn)
}

// DoInNetns runs fn on an OS thread switched into the network namespace at path.
func DoInNetns(path string, fn func() error) error {
	target, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("open own netns: %w", err)
			return
		}
		defer self.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(self.Fd()), unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: the runtime discards it when this goroutine exits.
			done <- errors.Join(ferr, fmt.Errorf("return from netns %s: %w", path, err))
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}

// Veth joins two namespaces with a veth pair: ifA with addrA (CIDR) in a, ifB with
// addrB in b, both up. Deleting either namespace removes the pair.
func Veth(t testing.TB, a *Netns, ifA, addrA string, b *Netns, ifB, addrB string) {
	t.Helper()
	tmp := "mdv" + RandSuffix(8)
	Run(t, "ip", "-n", a.Name, "link", "add", ifA, "type", "veth", "peer", "name", tmp)
	Run(t, "ip", "-n", a.Name, "link", "set", tmp, "netns", b.Name)
	b.IP(t, "link", "set", tmp, "name", ifB)
	if addrA != "" {
		a.IP(t, "addr", "add", addrA, "dev", ifA)
	}
	if addrB != "" {
		b.IP(t, "addr", "add", addrB, "dev", ifB)
	}
	a.IP(t, "link", "set", ifA, "up")
	b.IP(t, "link", "set", ifB, "up")
}

// Proc says where and as whom Command starts a process.
type Proc struct {
	Netns  *Netns  // nil: the test's own namespace
	Cgroup *Cgroup // nil: the test's own cgroup
	UID    int     // 0: root
	GID    int
	// NetOnly enters only the network namespace (nsenter --net) and keeps the
	// test's mounts: `ip netns exec` remounts /sys, which hides the cgroup2 mount
	// (an agent needs it), but it is what gives a process the namespace's
	// resolv.conf (clients need that).
	NetOnly bool
	// Caps, when not nil, is the only capabilities the process keeps (setpriv
	// --bounding-set; as root it then has exactly these), e.g. "bpf",
	// "net_admin".
	Caps []string
}

// Command builds a command that starts inside p.Cgroup (CLONE_INTO_CGROUP, before it
// runs a single instruction), in p.Netns (via `ip netns exec`, which also bind-mounts
// the namespace's resolv.conf, or nsenter with NetOnly), as p.UID/p.GID (via setpriv),
// with only p.Caps (via setpriv).
func Command(ctx context.Context, p Proc, name string, args ...string) *exec.Cmd {
	argv := []string{name}
	argv = append(argv, args...)
	if p.UID != 0 || p.GID != 0 {
		argv = append([]string{"setpriv", "--reuid=" + strconv.Itoa(p.UID), "--regid=" + strconv.Itoa(p.GID), "--clear-groups", "--"}, argv...)
	}
	if p.Caps != nil {
		argv = append(OnlyCaps(p.Caps), argv...)
	}
	switch {
	case p.Netns != nil && p.NetOnly:
		argv = append([]string{"nsenter", "--net=" + p.Netns.Path(), "--"}, argv...)
	case p.Netns != nil:
		argv = append([]string{"ip", "netns", "exec", p.Netns.Name}, argv...)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if p.Cgroup != nil {
		cmd.SysProcAttr.UseCgroupFD = true
		cmd.SysProcAttr.CgroupFD = p.Cgroup.FD()
	}
	return cmd
}

// OnlyCaps is the setpriv command line that runs the rest with only caps
// (bounding set; as root the process then has exactly these).
func OnlyCaps(caps []string) []string {
	set := "-all"
	for _, c := range caps {
		set += ",+" + c
	}
	return []string{"setpriv", "--bounding-set=" + set, "--inh-caps=-all", "--"}
}

// Children returns the pids of pid's child processes.
func Children(pid int) ([]int, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil, err
	}
	var out []int
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out, nil
}
