package kube

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The node agent in eBPF mode with the Kubernetes source and its in-cluster
// defaults: it discovers the cluster DNS Service's cluster IP from the API
// and captures it, so a pod whose resolv.conf names kube-dns (as every
// pod's does) gets cluster names from the agent, bare names in its own
// namespace, and everything else from the node's resolvers.
func TestCaptureClusterDNS(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "setpriv", "getent", "dig")
	c := startCluster(t)
	// kube-dns exists in every cluster: pods' resolv.conf names its IP.
	kubeDNS := c.createKubeDNS(t)
	dnsIP := kubeDNS.Spec.ClusterIP
	web := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})
	c.EnsureNamespace(t, "other")
	other := c.CreateService(t, kubetest.Service{Namespace: "other", Name: "web"})

	// The node: a network namespace with a pod behind a veth, the kube-dns
	// address on lo (a fake "real" kube-dns that knows no cluster name, so
	// an answer from it would show), and the node's own resolver.
	cg := testenv.NewCgroup(t)
	nodeNS := testenv.NewNetns(t, "mdk-node")
	pod := testenv.NewNetns(t, "mdk-pod")
	testenv.Veth(t, nodeNS, "vpod0", "169.254.101.1/30", pod, "eth0", "169.254.101.2/30")
	pod.IP(t, "route", "add", "default", "via", "169.254.101.1")
	nodeNS.IP(t, "addr", "add", dnsIP+"/32", "dev", "lo")
	nodeNS.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	realKubeDNS := testenv.StartFakeDNS(t, nodeNS, dnsIP+":53", nil)
	nodeResolver := testenv.StartFakeDNS(t, nodeNS, "169.254.53.1:53", upstreamNames)
	pod.SetResolvConf(t, "nameserver "+dnsIP+"\nsearch default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:1 attempts:2\n")
	c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: "client", Node: node, IPs: []string{"169.254.101.2"}, Ready: true})

	// The agent reaches the API server through a proxy into the node's
	// namespace (the API server listens on the test's loopback).
	resolvConf := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(resolvConf, []byte("nameserver 169.254.53.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	a := startNodeAgent(t, c, nodeNS, cg, "--resolv-conf", resolvConf, "--admin", "127.0.0.1:19154")

	getent := func(name string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var out bytes.Buffer
		cmd := testenv.Command(ctx, testenv.Proc{Netns: pod, Cgroup: cg, UID: 1000, GID: 1000}, "getent", "ahostsv4", name)
		cmd.Stdout = &out
		_ = cmd.Run()
		f := strings.Fields(out.String())
		if len(f) == 0 {
			return ""
		}
		return f[0]
	}
	if !testenv.WaitFor(30*time.Second, func() bool {
		a.MustRun(t)
		return getent("web") == web.Spec.ClusterIP
	}) {
		t.Fatalf("the pod never resolved web through the agent")
	}
	if !strings.Contains(a.Log.Tail(400), `capturing the cluster DNS Service`) {
		t.Errorf("the agent did not log the discovered cluster DNS Service")
	}
	realKubeDNS.Reset()
	for _, tt := range []struct{ name, want string }{
		{"web", web.Spec.ClusterIP},         // bare: the pod's own namespace
		{"web.other", other.Spec.ClusterIP}, // search-expanded: autopath
		{"web.other.svc.cluster.local", other.Spec.ClusterIP},
		{"ext.example.org", "192.0.2.80"}, // forwarded to the node's resolver
	} {
		if got := getent(tt.name); got != tt.want {
			t.Errorf("getent ahostsv4 %s in the pod = %q, want %q", tt.name, got, tt.want)
		}
	}
	if q := realKubeDNS.Queries(); len(q) > 0 {
		t.Errorf("the real kube-dns got %d queries, want 0 (all captured): %v", len(q), q)
	}
	if nodeResolver.Count("ext.example.org.") == 0 {
		t.Errorf("the node's resolver never saw the forwarded external name")
	}
}

// nodeAgent is the agent in eBPF mode in a node's network namespace,
// capturing a test cgroup, reaching the API server through a proxy into
// that namespace (it listens on the test's loopback).
type nodeAgent struct {
	*agenttest.Process
	stateDir, bpffs string
}

// nodeHost is what agents of one node share: the state dir and the bpffs
// (host paths in the DaemonSet).
type nodeHost struct {
	stateDir, bpffs string
}

func newNodeHost(t *testing.T) nodeHost {
	return nodeHost{stateDir: t.TempDir(), bpffs: filepath.Join(testenv.NewBPFFS(t), "meshdns")}
}

func startNodeAgent(t *testing.T, c *cluster, nodeNS *testenv.Netns, cg *testenv.Cgroup, extra ...string) *nodeAgent {
	t.Helper()
	return startNodeAgentOn(t, c, nodeNS, cg, newNodeHost(t), nil, extra...)
}

// startNodeAgentOn starts an agent on host's state dir and bpffs, with env
// added to the test's environment. The test's cleanup stops it.
func startNodeAgentOn(t *testing.T, c *cluster, nodeNS *testenv.Netns, cg *testenv.Cgroup, host nodeHost, env []string, extra ...string) *nodeAgent {
	t.Helper()
	apiPort := proxyIntoNetns(t, nodeNS, strings.TrimPrefix(c.Host(), "https://"))
	kubeconfig := rewriteServer(t, c.kubeconfig, fmt.Sprintf("https://127.0.0.1:%d", apiPort))
	a := &nodeAgent{stateDir: host.stateDir, bpffs: host.bpffs}
	args := []string{"run", "--mode", "ebpf", "--cgroup", cg.Path, "--kubeconfig", kubeconfig, "--node-name", node,
		"--listen", "169.254.20.53:53", "--bpffs", a.bpffs, "--state-dir", a.stateDir, "--log-level", "debug"}
	cmd := testenv.Command(context.Background(), testenv.Proc{Netns: nodeNS, Cgroup: cg, NetOnly: true}, agenttest.Agent(t), append(args, extra...)...)
	cmd.Env = append(os.Environ(), env...)
	a.Process = agenttest.Start(t, cmd, agenttest.Options{})
	return a
}

// proxyIntoNetns listens on 127.0.0.1 inside ns and forwards every
// connection to target in the test's own namespace. It returns the port.
func proxyIntoNetns(t *testing.T, ns *testenv.Netns, target string) int {
	t.Helper()
	var l net.Listener
	if err := ns.Do(func() (err error) {
		l, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer in.Close()
				out, err := net.DialTimeout("tcp", target, 5*time.Second)
				if err != nil {
					return
				}
				defer out.Close()
				go func() { _, _ = io.Copy(out, in) }()
				_, _ = io.Copy(in, out)
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

// rewriteServer copies a kubeconfig with another server URL (same CA: the
// API server's certificate names 127.0.0.1).
func rewriteServer(t *testing.T, kubeconfig, server string) string {
	t.Helper()
	b, err := os.ReadFile(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "server:") {
			l = l[:strings.Index(l, "server:")] + "server: " + server
		}
		out = append(out, l)
	}
	p := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(p, []byte(strings.Join(out, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
