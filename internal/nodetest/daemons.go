//go:build linux

package nodetest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// cniBinDir is where Debian's containernetworking-plugins puts the plugins.
const cniBinDir = "/usr/lib/cni"

// containerdConfig is containerd 2's configuration (version 3) with every path
// under the node's directory, runc from Debian, and the CRI's CNI bridge.
// restrict_oom_score_adj: the machine's sandbox lacks CAP_SYS_RESOURCE, and runc
// would fail to lower the pause container's oom_score_adj. NRI is off (it wants
// /var/run/nri).
func (n *Node) containerdConfig(pause string) string {
	d := func(p string) string { return filepath.Join(n.Dir, p) }
	return fmt.Sprintf(`version = 3
root = %q
state = %q
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = %q

[ttrpc]
  address = %q

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %q

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = [%q]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = %q
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%q]
    conf_dir = %q

[plugins."io.containerd.internal.v1.opt"]
  path = %q
`, d("containerd/root"), d("containerd/state"), d("containerd.sock"), d("containerd.sock.ttrpc"), pause,
		d("cdi"), d("runc"), cniBinDir, d("cni/net.d"), d("containerd/opt"))
}

// cniConfig is the pod network: a bridge with the node's pod range, the node's
// side of it the pods' gateway, no masquerade (nothing leaves the node).
const cniConfig = `{
  "cniVersion": "1.0.0",
  "name": "nodetest",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "` + PodCIDR + `"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "%s"}},
    {"type": "loopback"}
  ]
}`

func (n *Node) startContainerd(t testing.TB, opts Options) {
	t.Helper()
	netd := filepath.Join(n.Dir, "cni", "net.d")
	if err := os.MkdirAll(netd, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(netd, "10-nodetest.conflist"), fmt.Sprintf(cniConfig, filepath.Join(n.Dir, "cni", "ipam")))
	cfg := filepath.Join(n.Dir, "containerd.toml")
	writeFile(t, cfg, n.containerdConfig(opts.PauseImage))
	sock := filepath.Join(n.Dir, "containerd.sock")
	var took time.Duration
	n.containerd, took = n.CP.StartDaemon(t, "containerd", filepath.Join(n.bin, "containerd"),
		[]string{"--config", cfg, "--log-level", "warn"}, daemonTimeout, func() error {
			_, err := n.Run(filepath.Join(n.bin, "ctr"), "--address", sock, "version")
			return err
		})
	n.Timings.Containerd = took
}

// Ctr runs ctr against the node's containerd in the k8s.io namespace (the CRI's).
func (n *Node) Ctr(args ...string) (string, error) {
	return n.Run(filepath.Join(n.bin, "ctr"), append([]string{"--address", filepath.Join(n.Dir, "containerd.sock"), "-n", "k8s.io"}, args...)...)
}

func (n *Node) importImages(t testing.TB, archives []string) {
	t.Helper()
	start := time.Now()
	for _, a := range archives {
		if out, err := n.Ctr("images", "import", "--platform", "linux/amd64", a); err != nil {
			t.Fatalf("nodetest: import %s: %v", a, err)
		} else {
			t.Logf("nodetest: imported %s: %s", filepath.Base(filepath.Dir(a)), strings.TrimSpace(out))
		}
	}
	n.Timings.Images = time.Since(start)
}

// kubeletConfig: cgroupfs under the node's cgroup root, cgroup v1 allowed (a
// hybrid host counts as v1), anonymous access for the API server's exec and
// logs, kube-dns's ClusterIP as the pods' nameserver, and no eviction or image
// collection (the test's images are imported, never pulled).
func (n *Node) kubeletConfig(resolvConf string) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: %s
containerRuntimeEndpoint: unix://%s
address: %s
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
clusterDNS: [%s]
clusterDomain: cluster.local
resolvConf: %s
protectKernelDefaults: false
evictionHard: {"memory.available": "1Mi", "nodefs.available": "0%%", "imagefs.available": "0%%", "nodefs.inodesFree": "0%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
`, n.CgroupRoot, filepath.Join(n.Dir, "containerd.sock"), NodeIP, ClusterDNS, resolvConf)
}

// kubeProxyConfig: iptables mode in the node's namespace; conntrack sizes and
// timeouts left alone (the limits are the machine's, not the namespace's).
func (n *Node) kubeProxyConfig(kubeconfig string) string {
	return fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: %s}
hostnameOverride: %s
mode: iptables
clusterCIDR: %s
bindAddress: %s
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
`, kubeconfig, NodeName, PodCIDR, NodeIP)
}

// startNodeDaemons starts kube-scheduler, kubelet and kube-proxy and waits
// until the Node is Ready.
func (n *Node) startNodeDaemons(t testing.TB, opts Options) {
	t.Helper()
	resolv := filepath.Join(n.Dir, "node-resolv.conf")
	writeFile(t, resolv, opts.ResolvConf)
	n.CP.StartDaemon(t, "kube-scheduler", filepath.Join(n.bin, "kube-scheduler"), []string{
		"--kubeconfig", n.admin, "--leader-elect=false", "--bind-address", "127.0.0.1",
	}, daemonTimeout, func() error { return nil })

	kcfg := filepath.Join(n.Dir, "kubelet.yaml")
	writeFile(t, kcfg, n.kubeletConfig(resolv))
	start := time.Now()
	n.kubelet, _ = n.CP.StartDaemon(t, "kubelet", filepath.Join(n.bin, "kubelet"), []string{
		"--config", kcfg, "--kubeconfig", n.admin, "--hostname-override", NodeName, "--node-ip", NodeIP,
		"--cert-dir", filepath.Join(n.Dir, "kubelet-pki"), "--v", "1",
	}, nodeTimeout, n.nodeReady)
	n.Timings.NodeReady = time.Since(start)

	pcfg := filepath.Join(n.Dir, "kube-proxy.yaml")
	writeFile(t, pcfg, n.kubeProxyConfig(n.admin))
	n.CP.StartDaemon(t, "kube-proxy", filepath.Join(n.bin, "kube-proxy"), []string{"--config", pcfg},
		daemonTimeout, func() error {
			_, err := n.HTTPGet("http://127.0.0.1:10256/healthz")
			return err
		})
}

// nodeReady says whether the Node object has condition Ready=True and no taint
// (the node lifecycle controller lifts not-ready once kubelet reports Ready), so
// pods can be scheduled.
func (n *Node) nodeReady() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	node, err := n.CP.AdminClient().CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status != corev1.ConditionTrue {
				return fmt.Errorf("node %s: Ready=%s: %s", NodeName, c.Status, c.Message)
			}
			if len(node.Spec.Taints) > 0 {
				return fmt.Errorf("node %s is Ready but tainted %v", NodeName, node.Spec.Taints)
			}
			return nil
		}
	}
	return errors.New("node has no Ready condition yet")
}

// HTTPGet GETs url from inside the node's network namespace and returns the
// body of a 200 answer.
func (n *Node) HTTPGet(url string) (string, error) {
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: n.DialContext, DisableKeepAlives: true}}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), nil
}

// KubeletLog is kubelet's log so far.
func (n *Node) KubeletLog() string { return n.kubelet.Log() }

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatalf("nodetest: %v", err)
	}
}
