package kube

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// whoAskedSeries counts the series of the who-asked metrics in a scrape:
// per metric name, and the namespaces with their own series.
func whoAskedSeries(scrape string) (perMetric map[string]int, total int, namespaces map[string]bool) {
	perMetric, namespaces = map[string]int{}, map[string]bool{}
	for _, line := range strings.Split(scrape, "\n") {
		if !strings.HasPrefix(line, "meshdns_top_workload_") && !strings.HasPrefix(line, "meshdns_namespace_") {
			continue
		}
		name, labels, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		perMetric[name]++
		total++
		if ns, ok := strings.CutPrefix(labels, `client_namespace="`); ok && strings.HasPrefix(name, "meshdns_namespace_") {
			ns, _, _ = strings.Cut(ns, `"`)
			namespaces[ns] = true
		}
	}
	return perMetric, total, namespaces
}

// The who-asked metrics export a bounded number of series on a live agent:
// with 10 workloads (pods in 10 namespaces) and with 1,000 (990 more
// short-lived cgroups on the node), at most K + "(other)" per ranking, the
// window, and with --namespace-metrics the namespace cap + "(other)",
// "(none)" and "(unknown)" per counter (docs/observability.md); the rankings
// and the namespace counters still add up to every query.
func TestWhoAskedSeriesStayBounded(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "dig")
	c := startCluster(t)
	cg := testenv.NewCgroup(t)
	nodeNS := testenv.NewNetns(t, "mdk-card")
	nodeNS.IP(t, "addr", "add", "10.96.0.10/32", "dev", "lo") // the captured nameserver
	nodeNS.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	up := testenv.StartFakeDNS(t, nodeNS, "169.254.53.1:53", nil) // NXDOMAIN for everything: every query is new
	const k, nsLimit, pods, shortLived = 10, 5, 10, 990
	const admin = "127.0.0.1:19158"
	a := startNodeAgent(t, c, nodeNS, cg, "--nameservers", "10.96.0.10", "--upstream", "169.254.53.1",
		"--admin", admin, "--top-k", fmt.Sprint(k), "--top-window", "10m", "--namespace-metrics", "--namespace-metrics-limit", fmt.Sprint(nsLimit))

	// dig asks for each name (UDP; a second try after 5 s, as resolvers do,
	// for a machine this loaded) at the captured nameserver.
	dig := func(cgFD int, names ...string) error {
		out, err := runInFD(nodeNS, cgFD, 30*time.Second, append([]string{"dig", "+time=5", "+tries=2", "@10.96.0.10"}, names...)...)
		if err == nil && strings.Count(out, "status: NXDOMAIN") != len(names) {
			err = fmt.Errorf("want %d NXDOMAIN answers", len(names))
		}
		if err != nil {
			return fmt.Errorf("dig %v: %w:\n%s", names, err, out)
		}
		return nil
	}
	// Ten pods, each in its own namespace, host-network (their cgroups tell
	// them apart); pod i sends i+1 queries.
	kubepods := cg.Child(t, "kubepods.slice")
	var podCgs []*testenv.Cgroup
	for i := range pods {
		ns := fmt.Sprintf("card-%d", i)
		c.EnsureNamespace(t, ns)
		cid := randHex(64)
		pod := c.CreatePod(t, kubetest.Pod{Namespace: ns, Name: "app", Node: node, Ready: true, ContainerID: cid, HostNetwork: true})
		podCgs = append(podCgs, kubepods.Child(t, "kubepods-pod"+strings.ReplaceAll(string(pod.UID), "-", "_")+".slice").Child(t, "cri-containerd-"+cid+".scope"))
	}
	if !testenv.WaitFor(30*time.Second, func() bool {
		a.MustRun(t)
		return dig(podCgs[0].FD(), "ready.card.test") == nil
	}) {
		t.Fatal("no answer through the agent")
	}
	for i, pcg := range podCgs {
		var names []string
		for q := range i + 1 {
			names = append(names, fmt.Sprintf("q%d.pod%d.card.test", q, i))
		}
		if err := dig(pcg.FD(), names...); err != nil {
			t.Fatalf("pod %d: %v", i, err)
		}
	}
	check := func(stage string, workloads int) {
		t.Helper()
		checkWhoAskedSeries(t, stage, func() string { return getIn(t, nodeNS, "http://"+admin+"/metrics") }, up, workloads, k, nsLimit)
	}
	check("10 workloads", pods)

	// 990 more workloads: short-lived cgroups on the node, one query each, 8
	// at a time. A client that got no answer (this is a shared, loaded
	// machine; delivery is the capture tests' subject) is logged; more than
	// 1% of them fails the test.
	failed := runShortLived(t, cg.Child(t, "system.slice"), shortLived, nil, func(cgFD, i int, _ string) error {
		return dig(cgFD, fmt.Sprintf("q.sl%d.card.test", i))
	})
	if failed*100 > shortLived {
		t.Fatalf("%d of %d short-lived clients got no answer", failed, shortLived)
	}
	if t.Failed() {
		t.FailNow()
	}
	check("1,000 workloads", pods+shortLived)
}

// checkWhoAskedSeries checks one scrape of the who-asked metrics, once the
// top talkers count every query the upstream saw (each name is new, the
// readiness name aside; names, because the agent may try the upstream more
// than once per query): at most 3(K+1)+1+2(limit+3) series, K + (other)
// top talkers, the cap's namespaces + (other), and the namespace counters
// adding up to the rankings.
func checkWhoAskedSeries(t *testing.T, stage string, scrape func() string, up *testenv.FakeDNS, workloads, k, nsLimit int) {
	t.Helper()
	var m string
	var sum float64
	if !testenv.WaitFor(30*time.Second, func() bool {
		m = scrape()
		sum = 0
		for _, v := range metricValues(m, "meshdns_top_workload_queries") {
			sum += v
		}
		return sum >= float64(distinctNames(up))
	}) {
		t.Fatalf("%s: the top talkers count %v queries, the upstream saw %d names", stage, sum, distinctNames(up))
	}
	per, total, nss := whoAskedSeries(m)
	bound := 3*(k+1) + 1 + 2*(nsLimit+3)
	t.Logf("%s: %d workloads, %d queries; %d series (bound %d): %v; namespaces %v", stage, workloads, distinctNames(up), total, bound, per, nss)
	if total > bound {
		t.Errorf("%s: %d series of who-asked metrics, bound %d", stage, total, bound)
	}
	if got, want := per["meshdns_top_workload_queries"], min(workloads, k)+1; got != want {
		t.Errorf("%s: %d meshdns_top_workload_queries series, want %d (top %d + (other))", stage, got, want, k)
	}
	named := 0
	for ns := range nss {
		if !strings.HasPrefix(ns, "(") {
			named++
		}
	}
	if named != nsLimit || !nss["(other)"] {
		t.Errorf("%s: namespaces with their own series %v, want %d and (other)", stage, nss, nsLimit)
	}
	var nsSum float64
	for _, v := range metricValues(m, "meshdns_namespace_queries_total") {
		nsSum += v
	}
	if nsSum != sum {
		t.Errorf("%s: namespace counters add up to %v, the top talkers to %v", stage, nsSum, sum)
	}
}
