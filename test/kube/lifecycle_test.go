package kube

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// agentNS and agentDS are the DaemonSet's, as deploy/kubernetes names them.
const (
	agentNS = "meshdns-system"
	agentDS = "meshdns-ebpf"
	// clusterDNS is the captured nameserver; the "original" cluster DNS
	// behind it knows no cluster name (NXDOMAIN), so its answers show.
	clusterDNS = "10.96.0.10"
)

// lifecycleNode is one node of a DaemonSet whose pods the test runs as
// agents one after another (or side by side): the agent user has the
// shipped lifecycle roles (deploy/kubernetes/rbac.yaml) on top of its own.
type lifecycleNode struct {
	t      *testing.T
	c      *cluster
	ns     *testenv.Netns
	cg     *testenv.Cgroup
	host   nodeHost
	ref    *metav1.OwnerReference
	revoke func() // deletes the lifecycle roles (kubectl delete -k does)
	web    string // a Service's cluster IP the agent answers
	orig   *testenv.FakeDNS
}

func newLifecycleNode(t *testing.T) *lifecycleNode {
	t.Helper()
	testenv.RequirePrivileged(t, "ip", "nsenter", "setpriv", "dig")
	c := startCluster(t)
	c.EnsureNamespace(t, agentNS)
	_, ref := c.CreateDaemonSet(t, agentNS, agentDS)
	verbs := []string{"get", "list", "watch"}
	revokeCluster := c.Grant(t, agentUser, "", "meshdns-ebpf-lifecycle", []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, ResourceNames: []string{agentNS}, Verbs: verbs}})
	revokeNS := c.Grant(t, agentUser, agentNS, "meshdns-ebpf-lifecycle", []rbacv1.PolicyRule{
		{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{agentDS}, Verbs: verbs}})
	l := &lifecycleNode{t: t, c: c, cg: testenv.NewCgroup(t), host: newNodeHost(t), ref: ref,
		revoke: func() { revokeCluster(); revokeNS() }}
	l.web = c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"}).Spec.ClusterIP
	l.ns = testenv.NewNetns(t, "mdk-life")
	l.ns.IP(t, "addr", "add", clusterDNS+"/32", "dev", "lo")
	l.ns.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	l.orig = testenv.StartFakeDNS(t, l.ns, clusterDNS+":53", nil)
	testenv.StartFakeDNS(t, l.ns, "169.254.53.1:53", upstreamNames)
	return l
}

// startPod creates the DaemonSet's pod name on the node and runs its agent.
func (l *lifecycleNode) startPod(name string) *nodeAgent {
	l.t.Helper()
	l.c.CreatePod(l.t, kubetest.Pod{Namespace: agentNS, Name: name, Node: node, Controller: l.ref})
	return l.runAgent(name)
}

// runAgent runs the agent of pod name (which exists).
func (l *lifecycleNode) runAgent(name string) *nodeAgent {
	l.t.Helper()
	return startNodeAgentOn(l.t, l.c, l.ns, l.cg, l.host, []string{"POD_NAMESPACE=" + agentNS, "POD_NAME=" + name},
		"--nameservers", clusterDNS, "--upstream", "169.254.53.1")
}

// dig asks the captured cluster DNS for the Service from the captured cgroup:
// its cluster IP (the agent), NXDOMAIN (the original cluster DNS), or "" (no
// answer).
func (l *lifecycleNode) dig() string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	out, _ := testenv.Command(ctx, testenv.Proc{Netns: l.ns, Cgroup: l.cg, NetOnly: true}, "dig", "+tries=1", "+time=1",
		"@"+clusterDNS, "web.default.svc.cluster.local", "A").Output()
	switch s := string(out); {
	case strings.Contains(s, "status: NXDOMAIN"):
		return "NXDOMAIN"
	case strings.Contains(s, l.web):
		return l.web
	}
	return ""
}

func (l *lifecycleNode) waitAnswering(a *nodeAgent) {
	l.t.Helper()
	if !testenv.WaitFor(30*time.Second, func() bool { a.MustRun(l.t); return l.dig() == l.web }) {
		l.t.Fatalf("the agent never answered through capture\n%s", a.Log.Tail(40))
	}
}

// leftovers lists what agents left on the node: programs attached to the
// captured cgroup, pins, the node address, files in the state dir.
func (l *lifecycleNode) leftovers() []string {
	l.t.Helper()
	var out []string
	for _, at := range []ebpf.AttachType{ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect,
		ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg, ebpf.AttachCGroupUDP4Recvmsg, ebpf.AttachCGroupUDP6Recvmsg,
		ebpf.AttachCgroupInet4GetPeername, ebpf.AttachCgroupInet6GetPeername} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: l.cg.FD(), Attach: at})
		if err != nil {
			l.t.Fatal(err)
		}
		for range res.Programs {
			out = append(out, "program attached: "+at.String())
		}
	}
	_ = filepath.Walk(filepath.Dir(l.host.bpffs), func(p string, fi os.FileInfo, err error) error {
		if err == nil && p != filepath.Dir(l.host.bpffs) && !strings.HasSuffix(p, ".debug") {
			out = append(out, "pin: "+p)
		}
		return nil
	})
	if addrs := l.ns.IP(l.t, "addr", "show"); strings.Contains(addrs, "169.254.20.53") {
		out = append(out, "node address 169.254.20.53")
	}
	if ents, err := os.ReadDir(l.host.stateDir); err == nil {
		for _, e := range ents {
			out = append(out, "state: "+e.Name())
		}
	}
	return out
}

// A SIGTERM while the agent's DaemonSet and namespace stand is a restart: the
// programs stay attached and pinned, and the next agent adopts them. After
// `kubectl delete -k` (the namespace deleted, and the agent's roles with it,
// before the pod's SIGTERM) the node holds nothing of the agent: no program
// attached, no pin, no node address, nothing in the state dir; and queries
// reach the cluster DNS again.
func TestUninstallLeavesNothingRestartKeepsPins(t *testing.T) {
	l := newLifecycleNode(t)
	a := l.startPod("meshdns-ebpf-a")
	l.waitAnswering(a)
	if ok, _ := a.SignalAndWait(syscall.SIGTERM, 20*time.Second); !ok {
		t.Fatalf("the agent did not stop\n%s", a.Log.Tail(40))
	}
	left := l.leftovers()
	t.Logf("after a restart's SIGTERM: %v", left)
	if !strings.Contains(a.Log.Tail(200), "stopping for a restart") || !strings.Contains(strings.Join(left, "\n"), "pin: ") ||
		!strings.Contains(strings.Join(left, "\n"), "program attached") {
		t.Errorf("a restart must leave the programs attached and pinned for the next agent: %v\n%s", left, a.Log.Tail(40))
	}

	links := 0
	for _, e := range left {
		if strings.Contains(e, "pin: ") && strings.Contains(e, "/links/") {
			links++
		}
	}
	l.c.DeletePod(t, agentNS, "meshdns-ebpf-a")
	b := l.startPod("meshdns-ebpf-b")
	l.waitAnswering(b)
	if want := fmt.Sprintf("adopted_links=%d ", links); links == 0 || !strings.Contains(b.Log.Tail(400), want) {
		t.Errorf("the next agent did not adopt the %d pinned links (want %q in its log)\n%s", links, want, b.Log.Tail(40))
	}

	// kubectl delete -k: the namespace first, the roles next, then the pods
	// (the namespace controller, or the DaemonSet's garbage collection).
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := l.c.AdminClient().CoreV1().Namespaces().Delete(ctx, agentNS, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	l.revoke()
	stopped := time.Now()
	if ok, _ := b.SignalAndWait(syscall.SIGTERM, 20*time.Second); !ok {
		t.Fatalf("the agent did not stop\n%s", b.Log.Tail(40))
	}
	t.Logf("uninstall: the agent stopped %v after its SIGTERM", time.Since(stopped).Round(time.Millisecond))
	if left := l.leftovers(); len(left) > 0 {
		t.Errorf("an uninstall left: %v\n%s", left, b.Log.Tail(40))
	}
	if !strings.Contains(b.Log.Tail(400), "uninstall") {
		t.Errorf("the agent did not say it uninstalls\n%s", b.Log.Tail(40))
	}
	if got := l.dig(); got != "NXDOMAIN" {
		t.Errorf("after the uninstall a query got %q, want NXDOMAIN from the cluster DNS", got)
	}
}

// kubectl delete pod of the agent: the pod gets its deletionTimestamp, the
// DaemonSet controller creates its replacement on the node at once, and the
// kubelet SIGTERMs the agent while the replacement's container is still
// starting. The agent sees the replacement pod and serves on until its agent
// has taken over: a client asking all along gets every answer from an agent,
// none from the cluster DNS, and none is lost.
func TestDeletedAgentPodHandsOverToItsReplacement(t *testing.T) {
	l := newLifecycleNode(t)
	a := l.startPod("meshdns-ebpf-a")
	l.waitAnswering(a)

	var mu sync.Mutex
	got := map[string]int{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			r := l.dig()
			mu.Lock()
			got[r]++
			mu.Unlock()
		}
	}()

	l.c.DeletePodGracefully(t, agentNS, "meshdns-ebpf-a")
	l.c.CreatePod(t, kubetest.Pod{Namespace: agentNS, Name: "meshdns-ebpf-b", Node: node, Controller: l.ref})
	if err := a.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	signalled := time.Now()
	// The replacement's container starts a moment later.
	if !testenv.WaitFor(10*time.Second, func() bool { return strings.Contains(a.Log.Tail(100), "a replacement pod is starting") }) {
		t.Errorf("the agent did not wait for its replacement\n%s", a.Log.Tail(40))
	}
	time.Sleep(time.Second) // the kubelet starting the new container: what the old agent must bridge
	b := l.runAgent("meshdns-ebpf-b")
	if ok, _ := a.Wait(45 * time.Second); !ok {
		t.Fatalf("the old agent did not exit within the grace period\n%s", a.Log.Tail(40))
	}
	t.Logf("the old agent exited %v after its SIGTERM", time.Since(signalled).Round(time.Millisecond))
	l.waitAnswering(b)
	close(stop)
	wg.Wait()
	t.Logf("queries through the pod's deletion: %v (%s: the agent)", got, l.web)
	if got["NXDOMAIN"]+got[""] > 0 || got[l.web] == 0 {
		t.Errorf("through the deletion: %d answered by the cluster DNS, %d lost, %d by an agent; want all by an agent",
			got["NXDOMAIN"], got[""], got[l.web])
	}
	if !strings.Contains(b.Log.Tail(400), "took over from the previous agent") {
		t.Errorf("the replacement did not take over from the old agent\n%s", b.Log.Tail(40))
	}
}
