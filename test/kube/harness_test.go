// Package kube runs the meshdns-ebpf agent against a real Kubernetes control
// plane (kube-apiserver, etcd and kube-controller-manager from
// internal/kubetest) and checks what it answers: the Kubernetes node mode's
// acceptance tests. Pods are API objects whose status the test sets; the
// real endpointslice controller makes their EndpointSlices.
package kube

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

func TestMain(m *testing.M) {
	code := m.Run()
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// agentUser is the identity the agent runs as: a plain user bound to
// agentRole only.
const agentUser = "meshdns-agent"

// agentRole grants what the Kubernetes source reads.
var agentRole = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"services"}, Verbs: []string{"get", "list", "watch"}},
	{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"get", "list", "watch"}},
	{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
	// Namespaces' upstream budget annotations.
	{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "list", "watch"}},
	// The ServiceEntry source: Istio's CRD (that one object) and ServiceEntries.
	{APIGroups: []string{"apiextensions.k8s.io"}, Resources: []string{"customresourcedefinitions"},
		ResourceNames: []string{"serviceentries.networking.istio.io"}, Verbs: []string{"get", "list", "watch"}},
	{APIGroups: []string{"networking.istio.io"}, Resources: []string{"serviceentries"}, Verbs: []string{"get", "list", "watch"}},
}

// cluster is a control plane with the agent's identity set up.
type cluster struct {
	*kubetest.ControlPlane
	kubeconfig string // the agent user's
}

func startCluster(t *testing.T) *cluster {
	t.Helper()
	cp := kubetest.Start(t, kubetest.Options{ControllerManager: true, Users: []string{agentUser}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "meshdns-test-agent"}, Rules: agentRole}
	if _, err := cp.AdminClient().RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cp.BindClusterRole(t, role.Name, agentUser)
	return &cluster{ControlPlane: cp, kubeconfig: cp.Kubeconfig(t, agentUser)}
}

// createKubeDNS creates the cluster DNS Service every cluster has (pods'
// resolv.conf names its cluster IP): kube-system/kube-dns on port 53, UDP and
// TCP.
func (c *cluster) createKubeDNS(t *testing.T) *corev1.Service {
	t.Helper()
	return c.CreateService(t, kubetest.Service{Namespace: "kube-system", Name: "kube-dns", Ports: []corev1.ServicePort{
		{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP}, {Name: "dns-tcp", Port: 53, Protocol: corev1.ProtocolTCP}}})
}

// agent is the meshdns-ebpf binary running as resolver only (--mode off) on
// loopback, with the Kubernetes source.
type agent struct {
	*agenttest.Process
	t     *testing.T
	addr  string // resolver 127.0.0.1:port
	admin string
	up    *testenv.FakeDNS
}

// upstreamNames are what the fake upstream knows.
var upstreamNames = map[string][]netip.Addr{"ext.example.org": {netip.MustParseAddr("192.0.2.80")}}

func startAgent(t *testing.T, c *cluster, node string, extra ...string) *agent {
	t.Helper()
	a := &agent{t: t}
	a.up = testenv.StartFakeDNS(t, nil, "127.0.0.1:0", upstreamNames)
	a.addr = fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	a.admin = fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	args := []string{"run", "--mode", "off", "--listen", a.addr, "--admin", a.admin,
		"--upstream", a.up.Addr, "--state-dir", t.TempDir(), "--log-level", "debug"}
	if node != "" { // "": no Kubernetes source
		args = append(args, "--kubeconfig", c.kubeconfig, "--node-name", node)
	}
	a.Process = agenttest.Start(t, agenttest.Command(agenttest.Agent(t), append(args, extra...)...), agenttest.Options{})
	return a
}

// waitReady waits until /readyz is 200 and returns how long that took.
func (a *agent) waitReady(timeout time.Duration) time.Duration {
	a.t.Helper()
	start := time.Now()
	if !testenv.WaitFor(timeout, func() bool {
		a.MustRun(a.t)
		code, _ := a.get("/readyz")
		return code == http.StatusOK
	}) {
		code, body := a.get("/readyz")
		a.t.Fatalf("agent not ready within %v: %d %s\n%s", timeout, code, body, a.Log.Tail(40))
	}
	return time.Since(start)
}

func (a *agent) get(path string) (int, string) {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get("http://" + a.admin + path)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// metric returns the value of a metric line from /metrics (name with
// labels as printed), or -1.
func (a *agent) metric(series string) float64 {
	_, body := a.get("/metrics")
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, series+" ") {
			var v float64
			fmt.Sscanf(strings.TrimPrefix(l, series+" "), "%g", &v)
			return v
		}
	}
	return -1
}

// query sends one query over UDP from a local address ("" = any) and
// returns the response.
func (a *agent) query(from, name string, qtype uint16) (*dns.Msg, error) {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	c := &dns.Client{Net: "udp", Timeout: time.Second}
	if from != "" {
		c.Dialer = &net.Dialer{LocalAddr: &net.UDPAddr{IP: net.ParseIP(from)}, Timeout: time.Second}
	}
	resp, _, err := c.Exchange(m, a.addr)
	return resp, err
}

// answer summarises a response: "NXDOMAIN", "NODATA", or its records'
// data, sorted and space-separated (CNAME targets included).
func answer(resp *dns.Msg) string {
	if resp.Rcode != dns.RcodeSuccess {
		return dns.RcodeToString[resp.Rcode]
	}
	var out []string
	for _, rr := range resp.Answer {
		switch r := rr.(type) {
		case *dns.A:
			out = append(out, r.A.String())
		case *dns.AAAA:
			out = append(out, r.AAAA.String())
		case *dns.CNAME:
			out = append(out, "CNAME:"+r.Target)
		case *dns.SRV:
			out = append(out, fmt.Sprintf("SRV:%d:%s", r.Port, r.Target))
		case *dns.PTR:
			out = append(out, "PTR:"+r.Ptr)
		}
	}
	if len(out) == 0 {
		return "NODATA"
	}
	slices.Sort(out)
	return strings.Join(out, " ")
}

func (a *agent) ask(from, name string, qtype uint16) string {
	a.t.Helper()
	resp, err := a.query(from, name, qtype)
	if err != nil {
		return "ERROR " + err.Error()
	}
	return answer(resp)
}

// waitAnswer polls until name answers want, and returns how long that
// took after since.
func (a *agent) waitAnswer(since time.Time, name string, qtype uint16, want string, timeout time.Duration) time.Duration {
	a.t.Helper()
	var got string
	var at time.Duration
	// A short interval: the time it returns is what the tests measure.
	if !testenv.Poll(timeout, 2*time.Millisecond, func() bool {
		got, at = a.ask("", name, qtype), time.Since(since)
		return got == want
	}) {
		a.t.Fatalf("%s %s = %q, want %q within %v", name, dns.TypeToString[qtype], got, want, timeout)
	}
	return at
}

func percentile(ds []time.Duration, p float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s)-1) * p)
	return s[i]
}
