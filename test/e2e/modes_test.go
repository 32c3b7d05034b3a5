package e2e

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// TestClientsIptables: the client suite passes in iptables mode too,
// for processes on the node and in a pod; stop leaves no rule of ours.
func TestClientsIptables(t *testing.T) {
	testenv.RequirePrivileged(t, "iptables-save")
	n := newNode(t)
	n.start("iptables")
	if !n.logged("mode=iptables") {
		t.Fatalf("agent did not run in iptables mode:\n%s", n.stderr.String())
	}
	t.Run("node", func(t *testing.T) { runClients(t, n, n.ns, 1000, clientSuite()) })
	t.Run("pod", func(t *testing.T) { runClients(t, n, n.pod, 1000, clientSuite()) })
	if n.orig.Count(meshName) != 0 {
		t.Errorf("the original nameserver saw %d mesh queries: capture leaked", n.orig.Count(meshName))
	}
	if out, err := n.client(n.ns, 1337, "dig", "+time=2", "+tries=1", meshName); err != nil || !strings.Contains(out, "status: NXDOMAIN") {
		t.Errorf("proxy uid 1337 was captured in iptables mode (err %v):\n%s", err, out)
	}
	if err := n.signal(syscall.SIGTERM); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	if rules := n.ns.Exec(t, "iptables-save"); strings.Contains(strings.ToUpper(rules), "MESHDNS") {
		t.Errorf("iptables rules of ours left after stop:\n%s", rules)
	}
	n.assertClean()
}

// TestAutoMode: auto picks eBPF on this kernel, and iptables (saying
// why) when the eBPF probe fails.
func TestAutoMode(t *testing.T) {
	testenv.RequirePrivileged(t, "iptables-save")
	n := newNode(t)
	n.start("auto")
	if !n.logged("mode=ebpf") {
		t.Errorf("auto did not pick ebpf on this kernel:\n%s", n.stderr.String())
	}
	if len(n.attached()) == 0 {
		t.Errorf("auto mode attached no program")
	}
	if err := n.signal(syscall.SIGTERM); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	n.assertStopped()

	n.stderr = nil
	n.start("auto", "--x-force-no-ebpf", "cgroup/recvmsg4 unsupported (test)")
	for _, want := range []string{"mode=iptables", "falling back to iptables", "cgroup/recvmsg4 unsupported (test)"} {
		if !n.logged(want) {
			t.Errorf("agent log lacks %q:\n%s", want, n.stderr.String())
		}
	}
	if a := n.attached(); len(a) > 0 {
		t.Errorf("iptables fallback attached programs: %v", a)
	}
	runClients(t, n, n.pod, 1000, clientSuite()[:2])
	status, err := n.cli("status", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if err != nil || !strings.Contains(status, "iptables") || !strings.Contains(status, "recvmsg4 unsupported") {
		t.Errorf("status does not show the iptables mode and why (err %v):\n%s", err, status)
	}
	start := time.Now()
	if err := n.signal(syscall.SIGTERM); err != nil {
		t.Fatalf("agent exit: %v", err)
	}
	t.Logf("iptables mode stopped in %v", time.Since(start))
	if rules := n.ns.Exec(t, "iptables-save"); strings.Contains(strings.ToUpper(rules), "MESHDNS") {
		t.Errorf("iptables rules of ours left after stop:\n%s", rules)
	}
}
