package kube

import (
	"bytes"
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/redirect/socklb"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The agent captures the cluster DNS beside a socket load balancer attached
// before it on the capture cgroup (the tests' own, doing what Cilium's socket
// LB does: kube-dns ClusterIP:53 -> a CoreDNS pod:53), in the two ways a node
// allows: its programs go in front (ordered attach), or, with ordering
// switched off as on an older kernel, it captures the CoreDNS pod's address
// that the LB left, which it learns from the kube-dns EndpointSlices. glibc
// (getent) and dig over UDP and TCP get the agent's answers, from the
// ClusterIP they asked; the CoreDNS pod sees no query.
func TestCaptureClusterDNSBesideSocketLB(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "setpriv", "getent", "dig")
	c := startCluster(t)
	kubeDNS := c.createKubeDNS(t)
	dnsIP := netip.MustParseAddr(kubeDNS.Spec.ClusterIP)
	coreDNSIP := netip.MustParseAddr("10.99.53.10") // not link-local: an EndpointSlice refuses those
	c.CreatePod(t, kubetest.Pod{Namespace: "kube-system", Name: "coredns-0", Node: node,
		Labels: map[string]string{"app": "kube-dns"}, IPs: []string{coreDNSIP.String()}, Ready: true})
	c.WaitReadyEndpoints(t, "kube-system", "kube-dns", 1)
	web := c.CreateService(t, kubetest.Service{Namespace: "default", Name: "web"})

	for i, tc := range []struct {
		name      string
		unordered bool
	}{
		{"ours in front", false},
		{"backend capture", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cg := testenv.NewCgroup(t)
			nodeNS := testenv.NewNetns(t, "mdk-node")
			pod := testenv.NewNetns(t, "mdk-pod")
			testenv.Veth(t, nodeNS, "vpod0", "169.254.101.1/30", pod, "eth0", "169.254.101.2/30")
			pod.IP(t, "route", "add", "default", "via", "169.254.101.1")
			for _, a := range []string{dnsIP.String(), coreDNSIP.String(), "169.254.53.1"} {
				nodeNS.IP(t, "addr", "add", a+"/32", "dev", "lo")
			}
			realKubeDNS := testenv.StartFakeDNS(t, nodeNS, dnsIP.String()+":53", nil)
			coreDNS := testenv.StartFakeDNS(t, nodeNS, coreDNSIP.String()+":53", nil)
			testenv.StartFakeDNS(t, nodeNS, "169.254.53.1:53", upstreamNames)
			pod.SetResolvConf(t, "nameserver "+dnsIP.String()+"\nsearch default.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:1 attempts:2\n")
			c.CreatePod(t, kubetest.Pod{Namespace: "default", Name: "client-" + string(rune('a'+i)), Node: node, IPs: []string{"169.254.101.2"}, Ready: true})

			lb, err := socklb.Attach(cg.Path, socklb.Options{Services: map[netip.AddrPort]netip.AddrPort{
				netip.AddrPortFrom(dnsIP, 53): netip.AddrPortFrom(coreDNSIP, 53)}})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { lb.Close() })

			resolvConf := filepath.Join(t.TempDir(), "resolv.conf")
			if err := os.WriteFile(resolvConf, []byte("nameserver 169.254.53.1\n"), 0o644); err != nil {
				t.Fatal(err)
			}
			var env []string
			if tc.unordered {
				env = []string{redirect.UnorderedEnv + "=1"}
			}
			a := startNodeAgentOn(t, c, nodeNS, cg, newNodeHost(t), env, "--resolv-conf", resolvConf, "--admin", "127.0.0.1:19171")
			if !a.Log.WaitFor("cluster DNS Service backends captured", 30*time.Second) {
				a.MustRun(t)
				t.Fatalf("the agent never took the kube-dns backends from the EndpointSlices:\n%s", a.Log.Tail(40))
			}
			run := func(name string, args ...string) string {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				var out, errb bytes.Buffer
				cmd := testenv.Command(ctx, testenv.Proc{Netns: pod, Cgroup: cg, UID: 1000, GID: 1000}, name, args...)
				cmd.Stdout, cmd.Stderr = &out, &errb
				_ = cmd.Run()
				return out.String() + errb.String()
			}
			want := web.Spec.ClusterIP
			if !testenv.WaitFor(30*time.Second, func() bool {
				a.MustRun(t)
				f := strings.Fields(run("getent", "ahostsv4", "web"))
				return len(f) > 0 && f[0] == want
			}) {
				t.Fatalf("the pod never resolved web through the agent (getent: %q)", run("getent", "ahostsv4", "web"))
			}
			realKubeDNS.Reset()
			coreDNS.Reset()
			translated := lb.Translated()
			for _, q := range []struct {
				what string
				args []string
			}{
				{"dig udp", []string{"+short", "+tries=1", "@" + dnsIP.String(), "web.default.svc.cluster.local"}},
				{"dig +tcp", []string{"+short", "+tries=1", "+tcp", "@" + dnsIP.String(), "web.default.svc.cluster.local"}},
			} {
				// dig refuses a reply from another source than it asked.
				if got := strings.TrimSpace(run("dig", q.args...)); got != want {
					t.Errorf("%s: %q, want %s from the agent", q.what, got, want)
				}
			}
			if f := strings.Fields(run("getent", "ahostsv4", "web")); len(f) == 0 || f[0] != want {
				t.Errorf("getent ahostsv4 web: %v, want %s", f, want)
			}
			if n := len(coreDNS.Queries()) + len(realKubeDNS.Queries()); n != 0 {
				t.Errorf("CoreDNS and the kube-dns address got %d queries, want 0 (all captured)", n)
			}
			if got := lb.Translated() - translated; tc.unordered != (got > 0) {
				t.Errorf("the LB translated %d queries; want some only when ours cannot run first", got)
			}
		})
	}
}
