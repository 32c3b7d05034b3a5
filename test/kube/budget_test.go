package kube

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// budgetPod is a host-network pod of the budget test: its container's cgroup
// stands in for the one kubelet would make.
type budgetPod struct {
	ns, name string
	cg       *testenv.Cgroup
}

// Per-workload upstream budgets follow the annotations of the real API
// server: with a default budget of burst 5 at 1/s, a pod annotated with a
// larger one has 30 misses in a row forwarded while an unannotated pod of the
// same namespace gets REFUSED for most of its; a pod of an annotated
// namespace gets the namespace's budget; annotating a pod applies within
// seconds; a bad value falls back to the default, logged and counted.
func TestBudgetOverridesFollowAnnotations(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "dig")
	c := startCluster(t)
	c.EnsureNamespace(t, "team-a")
	c.EnsureNamespace(t, "team-b")
	big := map[string]string{"meshdns.io/upstream-qps": "100", "meshdns.io/upstream-burst": "100"}
	annotate(t, c, "", "team-b", big)

	cg := testenv.NewCgroup(t)
	nodeNS := testenv.NewNetns(t, "mdk-budget")
	nodeNS.IP(t, "addr", "add", "10.96.0.10/32", "dev", "lo") // the captured nameserver
	nodeNS.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	nodeNS.SetResolvConf(t, "nameserver 10.96.0.10\noptions timeout:3 attempts:1\n")
	testenv.StartFakeDNS(t, nodeNS, "169.254.53.1:53", nil) // NXDOMAIN for every name

	kubepods := cg.Child(t, "kubepods.slice")
	pods := map[string]*budgetPod{}
	for _, p := range []struct{ ns, name string }{{"team-a", "big"}, {"team-a", "plain"}, {"team-b", "inherits"}} {
		cid := randHex(64)
		pod := c.CreatePod(t, kubetest.Pod{Namespace: p.ns, Name: p.name, Node: node, Ready: true, ContainerID: cid, HostNetwork: true})
		pods[p.name] = &budgetPod{ns: p.ns, name: p.name,
			cg: kubepods.Child(t, "kubepods-pod"+strings.ReplaceAll(string(pod.UID), "-", "_")+".slice").Child(t, "cri-containerd-"+cid+".scope")}
	}
	annotate(t, c, "team-a", "big", big)

	const admin = "127.0.0.1:19158"
	startNodeAgent(t, c, nodeNS, cg, "--nameservers", "10.96.0.10", "--upstream", "169.254.53.1", "--admin", admin,
		"--workload-qps", "1", "--workload-burst", "5")

	round := 0
	// misses sends 30 distinct names that go upstream from p's cgroup, one
	// after the other, and counts the answers forwarded (NXDOMAIN from the
	// upstream) and REFUSED.
	misses := func(p *budgetPod) (forwarded, refused int) {
		round++
		args := []string{"dig", "+tries=1", "+time=3"}
		for i := range 30 {
			args = append(args, fmt.Sprintf("m%d-r%d.%s.budget.test", i, round, p.name))
		}
		out, _ := runIn(nodeNS, p.cg, 60*time.Second, args...)
		return strings.Count(out, "status: NXDOMAIN"), strings.Count(out, "status: REFUSED")
	}
	// want waits until p's 30 misses are all forwarded (all: true) or at
	// least 20 REFUSED (all: false).
	want := func(p *budgetPod, all bool, why string) {
		t.Helper()
		var f, r int
		if !testenv.WaitFor(30*time.Second, func() bool {
			f, r = misses(p)
			if all {
				return f == 30
			}
			return r >= 20
		}) {
			t.Fatalf("%s/%s (%s): last 30 misses: %d forwarded, %d REFUSED", p.ns, p.name, why, f, r)
		}
	}
	want(pods["big"], true, "its own annotation: burst 100")
	want(pods["inherits"], true, "its namespace's annotation: burst 100")
	want(pods["plain"], false, "no annotation: the default burst 5")

	// Annotating the pod applies to its existing budget.
	start := time.Now()
	annotate(t, c, "team-a", "plain", big)
	want(pods["plain"], true, "annotated while running")
	t.Logf("the annotation applied within %v", time.Since(start).Round(time.Millisecond))

	// A bad value: none of the pod's override, the default (team-a has none).
	annotate(t, c, "team-a", "big", map[string]string{"meshdns.io/upstream-qps": "fast", "meshdns.io/upstream-burst": "100"})
	want(pods["big"], false, "a bad annotation: the default")
	if got := metricValues(getIn(t, nodeNS, "http://"+admin+"/metrics"), "meshdns_budget_override_errors_total")[`{kind="pod"}`]; got != 1 {
		t.Errorf(`meshdns_budget_override_errors_total{kind="pod"} = %v, want 1`, got)
	}
}

// annotate merges annotations into Pod ns/name, or Namespace name when ns is "".
func annotate(t *testing.T, c *cluster, ns, name string, ann map[string]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var kv []string
	for k, v := range ann {
		kv = append(kv, fmt.Sprintf("%q:%q", k, v))
	}
	patch := []byte(`{"metadata":{"annotations":{` + strings.Join(kv, ",") + `}}}`)
	var err error
	if ns == "" {
		_, err = c.AdminClient().CoreV1().Namespaces().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	} else {
		_, err = c.AdminClient().CoreV1().Pods(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
	}
	if err != nil {
		t.Fatalf("annotate %s/%s: %v", ns, name, err)
	}
}
