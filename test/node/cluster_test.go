package node

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The workloads of the node: the stand-in cluster DNS behind kube-system/kube-dns,
// three client pods in two namespaces, a ClusterIP Service, a headless Service
// whose one ready endpoint is the Go client pod, and a ServiceEntry.
const (
	serviceEntryHost = "api.payments.example"
	serviceEntryIP   = "240.240.7.7"
	externalZone     = "ext.example" // answered by the fake upstream on the node
	externalIP       = "203.0.113.7"
)

func workloads() string {
	client := func(ns, name, image string, labels string) string {
		return fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: %s, labels: {app: %s%s}}
spec:
  terminationGracePeriodSeconds: 1
  # One attempt of 2 s: a lost query is a failed lookup, not hidden by a retry.
  dnsConfig: {options: [{name: timeout, value: "2"}, {name: attempts, value: "1"}]}
  containers:
    - {name: client, image: %s, imagePullPolicy: Never, command: [/pause]}
`, name, ns, name, labels, image)
	}
	return `apiVersion: v1
kind: Namespace
metadata: {name: team-a}
---
apiVersion: v1
kind: Namespace
metadata: {name: team-b}
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: ` + nodetest.ClusterDNS + `
  selector: {k8s-app: kube-dns}
  ports: [{name: dns, port: 53, protocol: UDP}, {name: dns-tcp, port: 53, protocol: TCP}]
---
apiVersion: v1
kind: Pod
metadata: {name: stand-in-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  terminationGracePeriodSeconds: 1
  dnsPolicy: Default
  containers:
    - name: dns
      image: ` + goImage + `
      imagePullPolicy: Never
      command: [/usr/local/bin/markerdns, -addr, ":53", -marker, ` + nodetest.Marker + `]
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: team-a}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80}]
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: team-b}
spec:
  clusterIP: None
  selector: {role: db-endpoint}
  ports: [{name: pg, port: 5432}]
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: payments, namespace: team-a}
spec:
  hosts: [` + serviceEntryHost + `]
  addresses: [` + serviceEntryIP + `]
  ports: [{number: 443, name: https, protocol: TLS}]
  location: MESH_EXTERNAL
  resolution: NONE
` + client("team-a", "glibc", glibcImage, "") + client("team-a", "musl", muslImage, "") +
		client("team-b", "go", goImage, ", role: db-endpoint")
}

// applyStdin runs kubectl apply -f - with manifest.
func applyStdin(t *testing.T, n *nodetest.Node, manifest string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := n.KubectlCommand(ctx, "apply", "-f", "-")
	cmd.Stdin = strings.NewReader(manifest)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply: %v\n%s", err, out)
	}
}

// kubectlJSON runs kubectl get ... -o json into v.
func kubectlJSON(t *testing.T, n *nodetest.Node, v any, args ...string) {
	t.Helper()
	out, err := n.Kubectl(append(args, "-o", "json")...)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("kubectl %v: %v", args, err)
	}
}

// podIP is a pod's IP.
func podIP(t *testing.T, n *nodetest.Node, ns, name string) string {
	t.Helper()
	out, err := n.Kubectl("get", "pod", "-n", ns, name, "-o", "jsonpath={.status.podIP}")
	if err != nil || net.ParseIP(out) == nil {
		t.Fatalf("pod %s/%s IP %q: %v", ns, name, out, err)
	}
	return out
}

// serviceIP is a Service's ClusterIP.
func serviceIP(t *testing.T, n *nodetest.Node, ns, name string) string {
	t.Helper()
	out, err := n.Kubectl("get", "service", "-n", ns, name, "-o", "jsonpath={.spec.clusterIP}")
	if err != nil || net.ParseIP(out) == nil {
		t.Fatalf("service %s/%s ClusterIP %q: %v", ns, name, out, err)
	}
	return out
}

// slowAPI is a TCP proxy on the node in front of the API server that holds
// every new connection for delay before connecting it: with the kubernetes
// Service pointed at it, an in-cluster client (the agent) needs at least delay
// to list anything, while kubelet and the controllers (which dial the API
// server directly) run at full speed.
type slowAPI struct {
	port  int
	delay atomic.Int64
}

func startSlowAPI(t *testing.T, n *nodetest.Node, backend string) *slowAPI {
	t.Helper()
	s := &slowAPI{}
	var l net.Listener
	if err := n.Netns.Do(func() error {
		var err error
		l, err = net.Listen("tcp", nodetest.NodeIP+":0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	s.port = l.Addr().(*net.TCPAddr).Port
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go s.serve(n, c, backend)
		}
	}()
	return s
}

func (s *slowAPI) serve(n *nodetest.Node, c net.Conn, backend string) {
	defer c.Close()
	time.Sleep(time.Duration(s.delay.Load())) // the slowness under test, not a wait
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	b, err := n.DialContext(ctx, "tcp", backend)
	cancel()
	if err != nil {
		return
	}
	defer b.Close()
	done := make(chan struct{}, 2)
	go func() { _, _ = copyConn(b, c); done <- struct{}{} }()
	go func() { _, _ = copyConn(c, b); done <- struct{}{} }()
	<-done
}

func copyConn(dst, src net.Conn) (int64, error) {
	buf := make([]byte, 32<<10)
	var total int64
	for {
		k, err := src.Read(buf)
		if k > 0 {
			if _, werr := dst.Write(buf[:k]); werr != nil {
				return total, werr
			}
			total += int64(k)
		}
		if err != nil {
			return total, err
		}
	}
}

// waitFor polls cond for up to d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	if !testenv.WaitFor(d, cond) {
		t.Fatalf("%s: not within %v", what, d)
	}
}
