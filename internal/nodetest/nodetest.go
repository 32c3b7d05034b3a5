//go:build linux

package nodetest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The node's fixed addresses: all inside namespaces the test creates.
const (
	NodeIP     = "10.99.0.1" // the node's "eth0"
	gatewayIP  = "10.99.0.2" // the other end of its veth, in a namespace of its own
	PodCIDR    = "10.244.0.0/24"
	ClusterDNS = "10.96.0.10" // kubelet's clusterDNS: the kube-dns Service's ClusterIP
	NodeName   = "nodetest"
	// Marker is what the stand-in cluster DNS answers for every name: a lookup
	// that returns it went around the agent to "the original nameserver".
	Marker = "192.0.2.53"
)

// Readiness limits: generous, as kubetest's (a busy shared machine).
const (
	daemonTimeout = 90 * time.Second
	nodeTimeout   = 120 * time.Second
)

// Options configure Start.
type Options struct {
	// SharedBPFFS makes the node's /sys/fs/bpf a shared mount, as systemd mounts
	// it; false leaves it private, which makes a hostPath volume with
	// HostToContainer propagation fail (CreateContainerError).
	SharedBPFFS bool
	// ResolvConf is kubelet's --resolv-conf content: the node's nameservers,
	// which pods with dnsPolicy Default (the agent) get.
	ResolvConf string
	// Images are OCI archives imported into containerd's k8s.io namespace before
	// kubelet starts (the pause image among them: PauseImage).
	Images []string
	// PauseImage is the sandbox image's reference (pinned in containerd).
	PauseImage string
}

// Timings are the measured costs of Start.
type Timings struct {
	Namespaces   time.Duration // netns, mount namespace, cgroups
	ControlPlane time.Duration // kubetest.Start
	Containerd   time.Duration // start to serving
	Images       time.Duration // every import
	NodeReady    time.Duration // kubelet start to the Node's Ready condition
	Total        time.Duration
}

func (tm Timings) String() string {
	r := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	return fmt.Sprintf("total %v (namespaces %v, control plane %v, containerd %v, image imports %v, kubelet to node Ready %v)",
		r(tm.Total), r(tm.Namespaces), r(tm.ControlPlane), r(tm.Containerd), r(tm.Images), r(tm.NodeReady))
}

// Node is one running node.
type Node struct {
	Name    string // the node's own name: netns, cgroup root, directory
	Dir     string // its files (short: unix sockets live here)
	Netns   *testenv.Netns
	MountNS string // the persistent mount namespace's file
	// CgroupRoot is kubelet's cgroupRoot ("/" + Name); UnifiedRoot its cgroup2
	// directory, which holds every pod (the capture cgroup of the agent).
	CgroupRoot, UnifiedRoot string
	CP                      *kubetest.ControlPlane
	Timings                 Timings

	t          testing.TB
	bin        string
	admin      string // admin kubeconfig
	containerd *kubetest.Daemon
	kubelet    *kubetest.Daemon

	teardownBegan time.Time
}

// Start brings a node up for the test and tears it down at cleanup. It skips
// (fails under CI) without root or a binary.
func Start(t testing.TB, opts Options) *Node {
	t.Helper()
	begin := time.Now()
	testenv.RequirePrivileged(t, "nsenter", "unshare", "mount", "ip", "runc", "iptables")
	bin := nodeBinDir(t)
	sweepStale(t)
	before, err := snapshotHost()
	if err != nil {
		t.Fatalf("nodetest: %v", err)
	}
	n := &Node{t: t, bin: bin, Name: testenv.OwnedName("nodetest", 6)}
	// Registered first, so it runs last: after every other cleanup of the node.
	t.Cleanup(func() { n.checkHostUnchanged(before) })
	n.Dir = filepath.Join(os.TempDir(), n.Name)
	if err := os.MkdirAll(n.Dir, 0o755); err != nil {
		t.Fatalf("nodetest: %v", err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(n.Dir); err != nil {
			t.Errorf("nodetest: remove %s: %v", n.Dir, err)
		}
	})
	n.setupNetwork(t)
	n.setupMountNS(t, opts)
	n.setupCgroups(t)
	n.Timings.Namespaces = time.Since(begin)

	cpStart := time.Now()
	n.CP = kubetest.Start(t, kubetest.Options{
		ControllerManager: true,
		Wrap:              n.Wrap(),
		Cgroup:            filepath.Join(n.UnifiedRoot, "system"),
		Address:           NodeIP,
		Dial:              n.DialContext,
		Controllers:       nodeControllers,
		// A real kubelet mounts each pod's service-account token.
		ServiceAccounts: true,
		APIServerArgs: []string{
			// kubectl exec/logs reach kubelet at the node IP, never through a lookup.
			"--kubelet-preferred-address-types=InternalIP",
		},
	})
	n.Timings.ControlPlane = time.Since(cpStart)
	n.admin = n.CP.Kubeconfig(t, kubetest.Admin)
	n.SetAPIEndpoint(t, n.CP.Port())

	n.startContainerd(t, opts)
	n.importImages(t, opts.Images)
	n.startNodeDaemons(t, opts)
	// Registered last, so it runs first: the teardown starts here.
	t.Cleanup(func() { n.teardownBegan = time.Now() })
	n.Timings.Total = time.Since(begin)
	t.Logf("nodetest: node %s Ready: %v", n.Name, n.Timings)
	return n
}

// nodeControllers are what a node with DaemonSets, Deployments and pods needs:
// kubetest's (EndpointSlices, garbage collection, role aggregation) and the
// workload controllers, the "default" ServiceAccount and kube-root-ca.crt of
// every namespace (a pod's token volume needs both), namespace deletion
// (`kubectl delete -k` waits for it), and the node lifecycle controller, which
// lifts the not-ready taint kubelet registers the node with.
const nodeControllers = "endpointslice,endpointslicemirroring,garbagecollector,clusterrole-aggregation," +
	"daemonset,deployment,replicaset,serviceaccount,root-ca-cert-publisher,namespace,nodelifecycle"

// nodeBinDir finds the node's binaries: $MESHDNS_NODE_BIN, else the repository's
// .cache/node-bin/<KubeVersion>. It skips (fails under CI) when one is missing.
func nodeBinDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("MESHDNS_NODE_BIN")
	if dir == "" {
		root, err := kubetest.RepoRoot()
		if err != nil {
			testenv.Skip(t, "nodetest: %v; set MESHDNS_NODE_BIN", err)
		}
		dir = filepath.Join(root, ".cache", "node-bin", kubetest.KubeVersion)
	}
	for _, b := range []string{"kubelet", "kube-scheduler", "kube-proxy", "kubectl", "containerd", "containerd-shim-runc-v2", "ctr"} {
		st, err := os.Stat(filepath.Join(dir, b))
		if err != nil || st.Mode()&0o111 == 0 {
			testenv.Skip(t, "nodetest: %s is not built in %s: run `scripts/build-kube.sh node` (make node-bin)", b, dir)
		}
	}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if _, err := os.Stat(filepath.Join(cniBinDir, p)); err != nil {
			testenv.Skip(t, "nodetest: the CNI plugin %s is missing in %s (Debian's containernetworking-plugins; make test installs it)", p, cniBinDir)
		}
	}
	return dir
}

// Wrap is the command prefix that runs a command inside the node: its mount and
// network namespaces.
func (n *Node) Wrap() []string {
	return []string{"nsenter", "--mount=" + n.MountNS, "--net=" + n.Netns.Path(), "--"}
}

// Command is a command run inside the node, as root, in the test's cgroup.
func (n *Node) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	argv := append(append(n.Wrap(), name), args...)
	return exec.CommandContext(ctx, argv[0], argv[1:]...)
}

// Run runs a command inside the node and returns its combined output; it is
// killed after 4 minutes (kubectl's own --timeout values stay below that).
func (n *Node) Run(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	out, err := n.Command(ctx, name, args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Kubectl runs the node's kubectl with the admin kubeconfig.
func (n *Node) Kubectl(args ...string) (string, error) {
	return n.Run(filepath.Join(n.bin, "kubectl"), append([]string{"--kubeconfig", n.admin}, args...)...)
}

// KubectlCommand is a kubectl command (admin) to run with its own stdio.
func (n *Node) KubectlCommand(ctx context.Context, args ...string) *exec.Cmd {
	return n.Command(ctx, filepath.Join(n.bin, "kubectl"), append([]string{"--kubeconfig", n.admin}, args...)...)
}

// DialContext dials from inside the node's network namespace.
func (n *Node) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := n.Netns.Do(func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// SetAPIEndpoint points the "kubernetes" Service (what in-cluster clients such as
// the agent dial) at port on the node IP: the API server's, or a proxy's in
// front of it. kube-proxy follows the EndpointSlice within milliseconds.
func (n *Node) SetAPIEndpoint(t testing.TB, port int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p32, name, proto := int32(port), "https", corev1.ProtocolTCP
	ready := true
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: "kubernetes", Namespace: "default", Labels: map[string]string{
			discoveryv1.LabelServiceName: "kubernetes", discoveryv1.LabelManagedBy: "nodetest",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{NodeIP}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &p32, Protocol: &proto}},
	}
	c := n.CP.AdminClient().DiscoveryV1().EndpointSlices("default")
	old, err := c.Get(ctx, "kubernetes", metav1.GetOptions{})
	if err == nil {
		es.ResourceVersion = old.ResourceVersion
		_, err = c.Update(ctx, es, metav1.UpdateOptions{})
	} else {
		_, err = c.Create(ctx, es, metav1.CreateOptions{})
	}
	if err != nil {
		t.Fatalf("nodetest: EndpointSlice of the kubernetes Service: %v", err)
	}
}

// checkHostUnchanged compares the machine with what Start recorded.
func (n *Node) checkHostUnchanged(before *hostState) {
	after, err := snapshotHost()
	if err != nil {
		n.t.Errorf("nodetest: after the teardown: %v", err)
		return
	}
	if d := before.diff(after, n.Name); len(d) > 0 {
		n.t.Errorf("nodetest: the machine is not as before the node:\n  %s", strings.Join(d, "\n  "))
		return
	}
	took := "a teardown of a node that never came up"
	if !n.teardownBegan.IsZero() {
		took = "teardown took " + time.Since(n.teardownBegan).Round(time.Millisecond).String()
	}
	n.t.Logf("nodetest: %s; after it the machine's %d writable sysctls, its mounts at %v, its top-level cgroups and network namespaces are as before",
		took, len(after.sysctls), mountWatch)
}
