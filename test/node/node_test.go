// Package node is the node end-to-end test (`make node-e2e`, part of `make test`):
// the shipped DaemonSet installed with the documented commands on a real
// single-node cluster (internal/nodetest) of this machine, pods of two namespaces
// resolving through it, and the agent rolled out, restarted, killed, stopped and
// uninstalled under 2,000 lookups/s from those pods. Every check prints its
// figures; the report is also written to out/node-e2e.txt.
package node

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// report collects each check's figures for the summary.
type report struct {
	mu    sync.Mutex
	lines []string
}

func (r *report) add(t *testing.T, format string, args ...any) {
	t.Helper()
	line := fmt.Sprintf(format, args...)
	t.Log(line)
	r.mu.Lock()
	r.lines = append(r.lines, t.Name()+": "+line)
	r.mu.Unlock()
}

// env is what every check shares: the node, the repository, the overlay.
type env struct {
	n        *nodetest.Node
	root     string
	dir      string
	rep      *report
	upstream *testenv.FakeDNS
	slow     *slowAPI
	// addresses the clients must get
	webIP, dbIP string
	installed   bool
	// helmInstalled: the chart is installed (HelmInstall passed, HelmUninstall not yet run)
	helmInstalled bool
	tag           string // the agent image tag in place
	// bpffsBefore is what the node's bpffs held before the install (the
	// kernel's own bpf_preload entries, maps.debug and progs.debug, where
	// it has them): uninstall must leave exactly that.
	bpffsBefore []string
}

func TestNode(t *testing.T) {
	testenv.RequirePrivileged(t, "nsenter", "unshare", "gcc", "musl-gcc", "make", "runc", "bpftool")
	root, err := kubetest.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	e := &env{root: root, dir: t.TempDir(), rep: &report{}, tag: agentTag}
	im := buildImages(t, root, filepath.Join(e.dir, "images"))
	e.rep.add(t, "images: %v", im)
	e.n = nodetest.Start(t, nodetest.Options{
		SharedBPFFS: true,
		ResolvConf:  "nameserver " + nodetest.NodeIP + "\n",
		Images:      im.archives,
		PauseImage:  pauseImage,
	})
	e.rep.add(t, "node: %v", e.n.Timings)
	// The image change of a rollout: the same image under a second tag.
	if out, err := e.n.Ctr("images", "tag", agentRepo+":"+agentTag, agentRepo+":"+agentTag2); err != nil {
		t.Fatalf("tag the agent's image: %v\n%s", err, out)
	}
	defer e.writeReport(t)
	// The node's nameserver (the agent's upstream): a fake on the node's IP.
	e.upstream = testenv.StartFakeDNS(t, e.n.Netns, nodetest.NodeIP+":53", map[string][]netip.Addr{
		"*." + externalZone: {netip.MustParseAddr(externalIP)},
	})
	e.slow = startSlowAPI(t, e.n, fmt.Sprintf("%s:%d", nodetest.NodeIP, e.n.CP.Port()))
	e.setupWorkloads(t)

	for _, c := range []struct {
		name string
		fn   func(*testing.T)
	}{
		{"Install", e.checkInstall},
		{"Resolution", e.checkResolution},
		{"CLI", e.checkCLI},
		{"RolloutRestart", func(t *testing.T) { e.checkRollout(t, "restart", 0) }},
		{"ImageChange", func(t *testing.T) { e.checkRollout(t, "image", 0) }},
		{"RolloutRestartSlowSync", func(t *testing.T) { e.checkRollout(t, "restart", slowSync) }},
		{"ImageChangeSlowSync", func(t *testing.T) { e.checkRollout(t, "image", slowSync) }},
		{"DeletePod", e.checkDeletePod},
		{"KillContainer", e.checkKill},
		{"SIGSTOP", func(t *testing.T) { e.checkStopped(t, "sigstop", loadRate) }},
		{"Freezer", func(t *testing.T) { e.checkStopped(t, "freezer", loadRate) }},
		{"SIGSTOPLowRate", func(t *testing.T) { e.checkStopped(t, "sigstop", lowRate) }},
		{"FreezerLowRate", func(t *testing.T) { e.checkStopped(t, "freezer", lowRate) }},
		// DNS-gated egress: the agent with components/egress, then the plain
		// install back for Uninstall.
		{"Egress", e.checkEgress},
		{"Uninstall", e.checkUninstall},
		// The same agent installed, upgraded under load and uninstalled with helm,
		// as docs/kubernetes.md's Helm section says.
		{"HelmInstall", e.checkHelmInstall},
		{"HelmUpgrade", func(t *testing.T) { e.checkRollout(t, "helm", 0) }},
		{"HelmUninstall", e.checkHelmUninstall},
		{"SocketLBFirst", e.checkSocketLB}, // after the uninstalls: fresh installs beside it
		{"BPFFSNotShared", e.checkBPFFSNotShared},
		{"BPFFSNotMounted", e.checkBPFFSNotMounted},
	} {
		t.Run(c.name, func(t *testing.T) {
			switch {
			case c.name == "HelmInstall":
				if !e.installed {
					t.Skip("the kubectl install failed: the node is not known to work")
				}
			case strings.HasPrefix(c.name, "Helm"):
				if !e.helmInstalled {
					t.Skip("the agent is not installed with helm (HelmInstall failed)")
				}
			case c.name != "Install" && !strings.HasPrefix(c.name, "BPFFS") && !e.installed:
				t.Skip("the agent is not installed (Install failed)")
			}
			c.fn(t)
		})
	}
}

// lowRate is the lookups per second of the stop checks on a nearly idle node:
// one lookup every 25 ms, the resolution of the fail-open delay there.
const lowRate = 40

// slowSync is how long the slowed API server holds each new connection of an
// in-cluster client: the new agent needs at least this long to sync.
const slowSync = 6 * time.Second

func (e *env) writeReport(t *testing.T) {
	e.rep.mu.Lock()
	defer e.rep.mu.Unlock()
	summary := "node end-to-end test (test/node):\n  " + strings.Join(e.rep.lines, "\n  ") + "\n"
	t.Log(summary)
	_ = os.MkdirAll(filepath.Join(e.root, "out"), 0o755)
	_ = os.WriteFile(filepath.Join(e.root, "out", "node-e2e.txt"), []byte(summary), 0o644)
}

// setupWorkloads creates the namespaces, the stand-in cluster DNS, the Services,
// the ServiceEntry and the client pods, and waits until every pod is Ready.
func (e *env) setupWorkloads(t *testing.T) {
	t.Helper()
	e.n.CP.InstallServiceEntryCRD(t)
	start := time.Now()
	applyStdin(t, e.n, workloads())
	for _, ns := range []string{"kube-system", "team-a", "team-b"} {
		if out, err := e.n.Kubectl("wait", "--for=condition=Ready", "pod", "--all", "-n", ns, "--timeout=100s"); err != nil {
			pods, _ := e.n.Kubectl("get", "pods", "-A", "-o", "wide")
			events, _ := e.n.Kubectl("get", "events", "-A")
			t.Fatalf("pods of %s not Ready: %v\n%s\n%s\n%s", ns, err, out, pods, events)
		}
	}
	e.webIP = serviceIP(t, e.n, "team-a", "web")
	e.dbIP = podIP(t, e.n, "team-b", "go")
	e.rep.add(t, "workloads: stand-in cluster DNS, 3 client pods in 2 namespaces, 2 Services and a ServiceEntry Ready in %v",
		time.Since(start).Round(time.Millisecond))
}
