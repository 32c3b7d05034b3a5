package kube

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// loadClients builds the load generators of test/e2e: getaddrinfo from glibc
// (connected UDP; TCP with "options use-vc") and musl (unconnected sendto),
// and Go's resolver.
func loadClients(t *testing.T) (glibc, musl, goload string) {
	t.Helper()
	return agenttest.Program(t, "dnsload-glibc", "gcc", "-O2", "-pthread", "-o", agenttest.Out, "test/e2e/testdata/dnsload/dnsload.c"),
		agenttest.Program(t, "dnsload-musl", "musl-gcc", "-static", "-O2", "-pthread", "-o", agenttest.Out, "test/e2e/testdata/dnsload/dnsload.c"),
		agenttest.GoBinary(t, "./test/e2e/testdata/goload")
}

// getIn fetches url from inside ns.
func getIn(t *testing.T, ns *testenv.Netns, url string) string {
	t.Helper()
	c := ns.HTTPClient(10 * time.Second)
	defer c.CloseIdleConnections()
	resp, err := c.Get(url)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// metricValues returns the samples of metric family name: label set -> value.
func metricValues(text, name string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			out[strings.TrimPrefix(line[:i], name)] = v
		}
	}
	return out
}

// sender is one workload of the test: what sends, and what the tap and the
// metrics must call it.
type sender struct {
	tag       string // the second label of its query names
	workload  string // the workload name it must get
	namespace string
	container string
	cgroupID  uint64
}

// Three pods in two namespaces (glibc over UDP, musl, glibc over TCP), a
// host-network pod (Go's resolver) and 1,000 short-lived cgroups on the node
// (glibc, musl and Go in turn, each cgroup removed once its client is done)
// send about 100,000 queries through the eBPF capture. Every query name says
// who sent it. Every query the upstream saw is in the tap, attributed to its
// sender (pod, container, cgroup id), and the top talkers and the
// per-namespace counters add up to the tap's counts.
func TestTapAndMetricsNameEveryQuery(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "nsenter", "gcc", "musl-gcc")
	glibc, musl, goload := loadClients(t)
	c := startCluster(t)
	c.EnsureNamespace(t, "team-a")
	c.EnsureNamespace(t, "team-b")
	cg := testenv.NewCgroup(t)
	nodeNS := testenv.NewNetns(t, "mdk-attr")
	nodeNS.IP(t, "addr", "add", "10.96.0.10/32", "dev", "lo") // the captured nameserver
	nodeNS.IP(t, "addr", "add", "169.254.53.1/32", "dev", "lo")
	nodeNS.SetResolvConf(t, "nameserver 10.96.0.10\noptions timeout:2 attempts:3\n")
	const shortLived = 1000
	records := map[string][]netip.Addr{}
	for _, tag := range []string{"web1", "web2", "api0", "hostnet", "ready"} {
		records["*."+tag+".attr.test"] = []netip.Addr{netip.MustParseAddr("192.0.2.1")}
	}
	for i := range shortLived {
		records[fmt.Sprintf("*.sl%d.attr.test", i)] = []netip.Addr{netip.MustParseAddr("192.0.2.1")}
	}
	up := testenv.StartFakeDNS(t, nodeNS, "169.254.53.1:53", records)

	senders, long := attributionPods(t, c, nodeNS, cg, glibc, musl, goload)

	const admin = "127.0.0.1:19157"
	a := startNodeAgent(t, c, nodeNS, cg, "--nameservers", "10.96.0.10", "--upstream", "169.254.53.1",
		"--admin", admin, "--top-window", "10m", "--namespace-metrics")
	ready := long[0]
	if !testenv.WaitFor(30*time.Second, func() bool {
		a.MustRun(t)
		out, _ := runIn(ready.ns, ready.cg, 10*time.Second, glibc, "-r", "10", "-t", "1", "-d", "0.2", "x%d.ready.attr.test=192.0.2.1")
		return strings.Contains(out, "ok=") && !strings.Contains(out, "ok=0 ")
	}) {
		t.Fatal("no answer through the agent")
	}

	tc := startTapCollector(t, nodeNS, a.stateDir, admin)

	// The long-lived pods, and meanwhile the short-lived cgroups, 8 at a
	// time; the pods send until the upstream has seen 100,000 queries (at
	// 2,800/s that is 40 s, longer when the machine is busy).
	start := time.Now()
	var wg sync.WaitGroup
	longCtx, stopLong := context.WithCancel(context.Background())
	defer stopLong()
	for _, cl := range long {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, err := runInCtx(longCtx, cl.ns, cl.cg.FD(), cl.argv...); err != nil {
				t.Errorf("%v: %v\n%s", cl.argv, err, out)
			}
		}()
	}
	var slMu sync.Mutex
	bins := []string{glibc, musl, goload}
	if n := runShortLived(t, cg.Child(t, "system.slice"), shortLived, func(tag string, s *sender) {
		slMu.Lock()
		defer slMu.Unlock()
		senders[tag] = s
	}, func(cgFD, i int, tag string) error {
		bin := bins[i%len(bins)]
		out, err := runInFD(nodeNS, cgFD, 20*time.Second, bin, "-r", "200", "-t", "1", "-d", dur(bin, 0.15), "q%d."+tag+".attr.test=192.0.2.1")
		if err != nil {
			return fmt.Errorf("%v\n%s", err, out)
		}
		return nil
	}); n > 0 {
		t.Errorf("%d short-lived clients failed", n)
	}
	if !testenv.WaitFor(5*time.Minute, func() bool { return distinctNames(up) >= 100_000 }) {
		t.Errorf("the upstream saw %d queries in 5 minutes, want 100,000", distinctNames(up))
	}
	stopLong()
	wg.Wait()
	t.Logf("clients done in %s", time.Since(start).Round(time.Millisecond))

	// Every query the upstream saw (each name is new: no cache) must be in the tap.
	seen := map[string]bool{}
	for _, q := range up.Queries() {
		if !strings.HasSuffix(q.Name, ".ready.attr.test.") {
			seen[q.Name] = true
		}
	}
	var byName map[string][]tap.Record
	testenv.WaitFor(30*time.Second, func() bool {
		byName = tc.byName()
		for n := range seen {
			if len(byName[n]) == 0 {
				return false
			}
		}
		return true
	})
	total, perWorkload, perNamespace := checkTapAttribution(t, seen, byName, senders, tc.lostRecords())
	checkTopTalkers(t, nodeNS, admin, total, perWorkload, perNamespace, senders)
	tc.stop()
}

// loadClient is a long-lived load generator in a pod.
type loadClient struct {
	argv []string
	ns   *testenv.Netns
	cg   *testenv.Cgroup
}

// attributionPods makes the test's four pods (API objects, their cgroups
// below cg, their network namespaces) and their load clients: web-1 (glibc)
// and web-2 (musl) in team-a, api-0 (glibc over TCP) and host-agent (Go,
// host network) in team-b. Their queries are q<n>.<tag>.attr.test.
func attributionPods(t *testing.T, c *cluster, nodeNS *testenv.Netns, cg *testenv.Cgroup, glibc, musl, goload string) (map[string]*sender, []loadClient) {
	t.Helper()
	kubepods := cg.Child(t, "kubepods.slice")
	senders := map[string]*sender{}
	var long []loadClient
	podSpecs := []struct {
		ns, name, tag, bin, conf string
		hostNet                  bool
	}{
		{"team-a", "web-1", "web1", glibc, "", false},
		{"team-a", "web-2", "web2", musl, "", false},
		{"team-b", "api-0", "api0", glibc, "options use-vc\n", false},
		{"team-b", "host-agent", "hostnet", goload, "", true},
	}
	for i, ps := range podSpecs {
		netns, ip := nodeNS, ""
		if !ps.hostNet {
			netns = testenv.NewNetns(t, "mdk-pod")
			ip = fmt.Sprintf("10.244.9.%d", 4*i+2)
			testenv.Veth(t, nodeNS, fmt.Sprintf("vp%d", i), fmt.Sprintf("10.244.9.%d/30", 4*i+1), netns, "eth0", ip+"/30")
			netns.IP(t, "route", "add", "default", "via", fmt.Sprintf("10.244.9.%d", 4*i+1))
			netns.SetResolvConf(t, "nameserver 10.96.0.10\noptions timeout:2 attempts:3\n"+ps.conf)
		}
		cid := randHex(64)
		kp := kubetest.Pod{Namespace: ps.ns, Name: ps.name, Node: node, Ready: true, ContainerID: cid, HostNetwork: ip == ""}
		if ip != "" {
			kp.IPs = []string{ip}
		}
		pod := c.CreatePod(t, kp)
		pcg := kubepods.Child(t, "kubepods-pod"+strings.ReplaceAll(string(pod.UID), "-", "_")+".slice").Child(t, "cri-containerd-"+cid+".scope")
		senders[ps.tag] = &sender{tag: ps.tag, workload: ps.ns + "/" + ps.name, namespace: ps.ns, container: "app", cgroupID: pcg.ID(t)}
		long = append(long, loadClient{ns: netns, cg: pcg,
			argv: []string{ps.bin, "-r", "700", "-t", "4", "-d", dur(ps.bin, 300), "q%d." + ps.tag + ".attr.test=192.0.2.1"}})
	}
	return senders, long
}

// tapCollector runs `meshdns-ebpf tap -o json` on the node, as an operator
// does, and keeps what it prints.
type tapCollector struct {
	cmd  *exec.Cmd
	done chan error
	mu   sync.Mutex
	recs []tap.Record
	lost uint64
}

// startTapCollector starts the tap of the agent with state directory
// stateDir in nodeNS and waits until the agent at admin counts it.
func startTapCollector(t *testing.T, nodeNS *testenv.Netns, stateDir, admin string) *tapCollector {
	t.Helper()
	tc := &tapCollector{done: make(chan error, 1)}
	tc.cmd = exec.Command("nsenter", "--net="+nodeNS.Path(), "--", agenttest.Agent(t), "tap", "--state-dir", stateDir, "-o", "json")
	stdout, err := tc.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	tc.cmd.Stderr = os.Stderr
	if err := tc.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		tc.done <- tap.Read(stdout, func(r *tap.Record) error {
			tc.mu.Lock()
			defer tc.mu.Unlock()
			if r.Lost > 0 {
				tc.lost += r.Lost
			} else {
				tc.recs = append(tc.recs, *r)
			}
			return nil
		})
	}()
	t.Cleanup(func() { _ = tc.cmd.Process.Kill(); _ = tc.cmd.Wait() })
	if !testenv.WaitFor(10*time.Second, func() bool {
		return metricValues(getIn(t, nodeNS, "http://"+admin+"/metrics"), "meshdns_tap_subscribers")[""] == 1
	}) {
		t.Fatal("the tap did not subscribe")
	}
	return tc
}

// byName is the records so far, by query name.
func (tc *tapCollector) byName() map[string][]tap.Record {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	out := map[string][]tap.Record{}
	for _, r := range tc.recs {
		out[r.Qname] = append(out[r.Qname], r)
	}
	return out
}

func (tc *tapCollector) lostRecords() uint64 {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	return tc.lost
}

// stop interrupts the tap as Ctrl-C does.
func (tc *tapCollector) stop() {
	_ = tc.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-tc.done:
	case <-time.After(5 * time.Second):
	}
}

// runShortLived runs n short-lived cgroups below system, 8 at a time: each
// made, its client run by send (given the open cgroup and its tag, "sl<i>"),
// and removed; record is told who each is. A client that fails is logged;
// the number of them is returned.
func runShortLived(t *testing.T, system *testenv.Cgroup, n int, record func(tag string, s *sender), send func(cgFD, i int, tag string) error) int {
	t.Helper()
	mount, err := cgroup2.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var failed atomic.Int32
	slots := make(chan struct{}, 8)
	for i := range n {
		slots <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			tag := fmt.Sprintf("sl%d", i)
			dir := filepath.Join(system.Path, fmt.Sprintf("run-u%d.scope", i))
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Errorf("create %s: %v", dir, err)
				return
			}
			slcg := openCgroup(t, dir)
			if record != nil {
				record(tag, &sender{tag: tag, workload: strings.TrimPrefix(dir, mount), cgroupID: slcg.id})
			}
			if err := send(slcg.fd, i, tag); err != nil {
				failed.Add(1)
				t.Logf("short-lived %s: %v", tag, err)
			}
			slcg.close()
			if !testenv.WaitFor(5*time.Second, func() bool { return os.Remove(dir) == nil }) {
				t.Errorf("remove %s", dir)
			}
		}()
	}
	wg.Wait()
	return int(failed.Load())
}

// checkTapAttribution checks that every query the upstream saw is in the tap
// and that every tap record names its sender; it returns the records and
// their counts per workload and per namespace.
func checkTapAttribution(t *testing.T, seen map[string]bool, byName map[string][]tap.Record, senders map[string]*sender, lost uint64) (total int, perWorkload, perNamespace map[string]int) {
	t.Helper()
	wrong, missing := 0, 0
	perWorkload, perNamespace = map[string]int{}, map[string]int{}
	for n := range seen {
		if len(byName[n]) == 0 {
			missing++
			if missing <= 5 {
				t.Errorf("query %s: not in the tap", n)
			}
		}
	}
	for name, rs := range byName {
		labels := strings.Split(name, ".")
		if len(labels) < 4 || labels[len(labels)-3] != "attr" || labels[1] == "ready" {
			continue
		}
		s := senders[labels[1]]
		for _, r := range rs {
			total++
			perWorkload[r.Workload]++
			if r.Namespace != "" {
				perNamespace[r.Namespace]++
			} else {
				perNamespace["(none)"]++
			}
			if s == nil || r.Workload != s.workload || r.CgroupID != s.cgroupID || r.Container != s.container || r.Namespace != s.namespace || r.By != "cgroup" {
				wrong++
				if wrong <= 10 {
					t.Errorf("%s: tap says %s (namespace %q container %q cgroup %d by %s), want %+v", name, r.Workload, r.Namespace, r.Container, r.CgroupID, r.By, s)
				}
			}
		}
	}
	t.Logf("%d queries seen upstream; %d tap records, %d attributed wrongly, %d missing, %d lost", len(seen), total, wrong, missing, lost)
	if len(seen) < 100000 {
		t.Errorf("only %d distinct queries reached the upstream, want at least 100,000", len(seen))
	}
	return total, perWorkload, perNamespace
}

// checkTopTalkers checks the metrics: the four pods are the top talkers with
// exactly the tap's counts, everything adds up, and the series are bounded.
func checkTopTalkers(t *testing.T, nodeNS *testenv.Netns, admin string, total int, perWorkload, perNamespace map[string]int, senders map[string]*sender) {
	t.Helper()
	var m string
	if !testenv.WaitFor(30*time.Second, func() bool {
		m = getIn(t, nodeNS, "http://"+admin+"/metrics")
		var sum float64
		for _, v := range metricValues(m, "meshdns_top_workload_queries") {
			sum += v
		}
		return sum >= float64(total)
	}) {
		t.Errorf("top talkers never added up to the tap's %d records", total)
	}
	top := metricValues(m, "meshdns_top_workload_queries")
	for _, tag := range []string{"web1", "web2", "api0", "hostnet"} {
		s := senders[tag]
		ns, pod, _ := strings.Cut(s.workload, "/")
		key := fmt.Sprintf(`{client_namespace=%q,client_pod=%q,workload=%q}`, ns, pod, s.workload)
		// The readiness probe's few queries came from web-1 too.
		if got, want := top[key], perWorkload[s.workload]; got < float64(want) || (tag != "web1" && got != float64(want)) {
			t.Errorf("top talkers: %s = %v, want %d (the tap's count)", key, got, want)
		}
	}
	nsq := metricValues(m, "meshdns_namespace_queries_total")
	for ns, want := range perNamespace {
		if got := nsq[fmt.Sprintf(`{client_namespace=%q}`, ns)]; got < float64(want) || (ns != "team-a" && got != float64(want)) {
			t.Errorf("meshdns_namespace_queries_total{client_namespace=%q} = %v, want %d", ns, got, want)
		}
	}
	_, series, _ := whoAskedSeries(m)
	t.Logf("top talkers and namespace series: %d; top queries: %v", series, top)
	if series > 3*(10+1)+1+2*(50+3) {
		t.Errorf("%d per-workload series", series)
	}
}

func randHex(n int) string {
	b := make([]byte, n/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// openedCgroup is a cgroup directory opened for CLONE_INTO_CGROUP.
type openedCgroup struct {
	f  *os.File
	fd int
	id uint64
}

func openCgroup(t *testing.T, dir string) *openedCgroup {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return &openedCgroup{f: f, fd: int(f.Fd()), id: st.Ino}
}

func (c *openedCgroup) close() { c.f.Close() }

// runIn runs argv in ns (with its resolv.conf) inside cg.
func runIn(ns *testenv.Netns, cg *testenv.Cgroup, timeout time.Duration, argv ...string) (string, error) {
	return runInFD(ns, cg.FD(), timeout, argv...)
}

func runInFD(ns *testenv.Netns, cgFD int, timeout time.Duration, argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return runInCtx(ctx, ns, cgFD, argv...)
}

// runInCtx runs argv in ns inside the cgroup open as cgFD until it exits or
// ctx ends; then it gets SIGTERM (the load clients stop and report), and
// SIGKILL 10 s later.
func runInCtx(ctx context.Context, ns *testenv.Netns, cgFD int, argv ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns.Name}, argv...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cgFD, Setpgid: true}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if errors.Is(err, context.Canceled) {
		err = nil // stopped as asked, and it exited cleanly (Wait reports the cancel then)
	}
	return string(out), err
}

// distinctNames is how many names the fake upstream was asked.
func distinctNames(up *testenv.FakeDNS) int {
	names := map[string]bool{}
	for _, q := range up.Queries() {
		names[q.Name] = true
	}
	return len(names)
}

// dur is a -d argument: seconds for dnsload, a Go duration for goload.
func dur(bin string, secs float64) string {
	if strings.HasSuffix(bin, "goload") {
		return time.Duration(secs * float64(time.Second)).String()
	}
	return strconv.FormatFloat(secs, 'f', -1, 64)
}
