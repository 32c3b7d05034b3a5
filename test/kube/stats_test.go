package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// `meshdns-ebpf stats` names the pod of each cgroup (namespace/name, from
// the Pods of this node the agent watches) instead of its raw path: two
// pods' cgroups laid out as kubelet does with the systemd driver and with
// the cgroupfs driver, each sending queries through the eBPF datapath.
func TestStatsNamePods(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "dig")
	c := startCluster(t)
	web := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})
	c.EnsureNamespace(t, "team-b")
	podA := c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: "client", Node: node, IPs: []string{"10.244.7.7"}, Ready: true})
	podB := c.CreatePod(t, kubetest.Pod{Namespace: "team-b", Name: "api-0", Node: node, IPs: []string{"10.244.7.8"}, Ready: true})

	cg := testenv.NewCgroup(t)
	uidA, uidB := string(podA.UID), string(podB.UID)
	cgA := childCgroup(t, cg.Path, "kubepods.slice", "kubepods-besteffort.slice",
		"kubepods-besteffort-pod"+strings.ReplaceAll(uidA, "-", "_")+".slice", "cri-containerd-0a1b2c.scope")
	cgB := childCgroup(t, cg.Path, "kubepods", "burstable", "pod"+uidB, "3d4e5f")

	nodeNS := testenv.NewNetns(t, "mdk-stats")
	nodeNS.IP(t, "addr", "add", "10.96.0.10/32", "dev", "lo") // the captured nameserver
	nodeNS.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	testenv.StartFakeDNS(t, nodeNS, "169.254.53.1:53", upstreamNames)
	a := startNodeAgent(t, c, nodeNS, cg, "--nameservers", "10.96.0.10", "--upstream", "169.254.53.1", "--admin", "127.0.0.1:19155")
	stateDir, bpffs, bin := a.stateDir, a.bpffs, agenttest.Agent(t)

	// dig from a pod's cgroup to the captured nameserver.
	dig := func(cgDir string) string {
		fd, err := os.Open(cgDir)
		if err != nil {
			t.Fatal(err)
		}
		defer fd.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		q := exec.CommandContext(ctx, "nsenter", "--net="+nodeNS.Path(), "--", "dig", "+short", "+tries=1", "+time=1",
			"@10.96.0.10", "web.default.svc.cluster.local", "A")
		q.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd()), Setpgid: true}
		var out bytes.Buffer
		q.Stdout = &out
		_ = q.Run()
		return strings.TrimSpace(out.String())
	}
	if !testenv.WaitFor(30*time.Second, func() bool {
		a.MustRun(t)
		return dig(cgA) == web.Spec.ClusterIP
	}) {
		t.Fatalf("no answer through the agent")
	}
	for range 3 {
		if got := dig(cgB); got != web.Spec.ClusterIP {
			t.Fatalf("dig from pod B's cgroup = %q", got)
		}
	}

	// The CLI runs on the node: the agent's admin address is in its
	// network namespace, found through the state file.
	stats := func(format string) string {
		out, err := exec.Command("nsenter", "--net="+nodeNS.Path(), "--", bin, "stats", "--state-dir", stateDir, "--bpffs", bpffs, "-o", format).CombinedOutput()
		if err != nil {
			t.Fatalf("stats: %v\n%s", err, out)
		}
		return string(out)
	}
	var s struct {
		Cgroups []struct {
			Path          string `json:"path"`
			Pod           string `json:"pod"`
			RedirectedUDP uint64 `json:"redirected_udp"`
		} `json:"cgroups"`
	}
	if err := json.Unmarshal([]byte(stats("json")), &s); err != nil {
		t.Fatal(err)
	}
	got := map[string]uint64{}
	for _, cs := range s.Cgroups {
		if cs.Pod != "" {
			got[cs.Pod] += cs.RedirectedUDP
		}
	}
	if got["default/client"] == 0 || got["team-b/api-0"] < 3 {
		t.Errorf("per-pod redirects = %v, want default/client and team-b/api-0 (3+) named", got)
	}
	table := stats("table")
	t.Logf("meshdns-ebpf stats:\n%s", table)
	for _, want := range []string{"pod default/client", "pod team-b/api-0"} {
		if !strings.Contains(table, want) {
			t.Errorf("stats table does not name %q", want)
		}
	}
}

// childCgroup makes nested cgroup directories below parent (kubelet's
// layout) and removes them, deepest first, at cleanup (before the parent).
func childCgroup(t *testing.T, parent string, names ...string) string {
	t.Helper()
	dirs := []string{}
	p := parent
	for _, n := range names {
		p = filepath.Join(p, n)
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, p)
	}
	t.Cleanup(func() {
		for i := len(dirs) - 1; i >= 0; i-- {
			if !testenv.WaitFor(5*time.Second, func() bool {
				b, _ := os.ReadFile(filepath.Join(dirs[i], "cgroup.procs"))
				for _, f := range strings.Fields(string(b)) {
					var pid int
					fmt.Sscan(f, &pid)
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
				return os.Remove(dirs[i]) == nil
			}) {
				t.Errorf("remove cgroup %s", dirs[i])
			}
		}
	})
	return p
}
