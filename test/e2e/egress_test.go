package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/connload"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The egress tests' world: an "internet" namespace behind the node where every
// address of 198.18.0.0/15 accepts TCP and echoes UDP on internetPort, and names
// of the original nameserver that answer into it: fresh.test a new address of
// 198.18.0.0/16 with TTL 1 on every query, allowed.test and notallowed.test fixed
// ones. Connects to 198.19.x.y are to addresses no answer ever named.
const (
	internetPort = 8443
	freshName    = "fresh.test"
	allowedName  = "allowed.test"
	allowedIP    = "198.18.250.1"
	unlistedName = "notallowed.test"
	unlistedIP   = "198.18.250.2"
	neverPrefix  = "198.19"
)

// egressNode is a node whose pod namespace reaches the internet, with a client
// cgroup per policy under the captured cgroup.
type egressNode struct {
	*node
	inet *testenv.Internet
	cgs  map[string]*testenv.Cgroup // by policy name
	file string                     // the policy file
}

// newEgressNode builds the node and its internet, and writes a policy file with
// one policy per entry of modes ("enforce/fail-open", "audit/fail-open", ...),
// each selecting a client cgroup of its own and allowing fresh.test and
// allowed.test.
func newEgressNode(t *testing.T, modes map[string]string) *egressNode {
	t.Helper()
	n := &egressNode{node: newNode(t), cgs: map[string]*testenv.Cgroup{}}
	world := testenv.NewNetns(t, "mde-inet")
	testenv.Veth(t, n.ns, "vinet", "169.254.110.1/30", world, "eth0", "169.254.110.2/30")
	n.ns.IP(t, "route", "add", "198.18.0.0/15", "via", "169.254.110.2")
	world.IP(t, "route", "add", "default", "via", "169.254.110.1")
	n.ns.Exec(t, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	n.inet = testenv.StartInternet(t, world, netip.MustParsePrefix("198.18.0.0/15"), internetPort)
	n.orig.SetFresh(freshName, netip.MustParsePrefix("198.18.0.0/16"), 1)
	n.orig.Set(allowedName, netip.MustParseAddr(allowedIP))
	n.orig.Set(unlistedName, netip.MustParseAddr(unlistedIP))

	var b strings.Builder
	b.WriteString("policies:\n")
	for name, mode := range modes {
		m, fail, _ := strings.Cut(mode, "/")
		cg := n.cg.Child(t, "clients-"+name)
		n.cgs[name] = cg
		fmt.Fprintf(&b, "  - name: %s\n    cgroup: %s\n    mode: %s\n    failMode: %s\n    egress:\n      - names: [%s, %s]\n",
			name, cg.Path, m, fail, freshName, allowedName)
	}
	n.file = filepath.Join(t.TempDir(), "egress.yaml")
	if err := os.WriteFile(n.file, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n *egressNode) start() {
	n.t.Helper()
	n.node.start("ebpf", n.egressArgs()...)
	if !testenv.WaitFor(10*time.Second, func() bool { return n.metric("meshdns_egress_selected_workloads") == float64(len(n.cgs)) }) {
		n.t.Fatalf("the agent selects %v workloads, want %d:\n%s", n.metric("meshdns_egress_selected_workloads"), len(n.cgs), n.stderr.String())
	}
}

// egressArgs are the agent's egress flags. The answer cache is off
// (--cache-bytes 1): every lookup of fresh.test reaches the upstream and gets an
// address no answer named before, so every connect races its own answer.
func (n *egressNode) egressArgs() []string {
	return []string{"--egress", "--egress-policy-file", n.file, "--cache-bytes", "1"}
}

// connects runs a resolve -> connect client in the cgroup of policy, in the
// pod's namespace, as UID 1000.
func (n *egressNode) connects(policy string, argv ...string) connload.Summary {
	n.t.Helper()
	out, err := n.clientIn(n.cgs[policy], n.pod, 1000, 90*time.Second, argv[0], argv[1:]...)
	if err != nil {
		n.t.Fatalf("%v: %v\n%s", argv, err, out)
	}
	r, err := connload.Parse(out, 20)
	if err != nil {
		n.t.Fatal(err)
	}
	return r
}

// egressClients are the resolve -> connect clients: glibc and musl over TCP,
// musl over UDP, Go over TCP.
func egressClients(cycles int, args ...string) map[string][]string {
	c := strconv.Itoa(cycles)
	p := strconv.Itoa(internetPort)
	return map[string][]string{
		"glibc-tcp": append([]string{bins.egressGlibc, "-n", c, "-p", p}, args...),
		"musl-tcp":  append([]string{bins.egressMusl, "-n", c, "-p", p}, args...),
		"musl-udp":  append([]string{bins.egressMusl, "-n", c, "-p", p, "-u"}, args...),
		"go-tcp":    append([]string{bins.egressGo, "-n", c, "-p", p}, args...),
	}
}

// TestEgressGrantsBeforeTheAnswer: in enforce mode, every connect to an address
// an allowed name just resolved to is let through (a name with TTL 1 that
// answers a fresh address every time: 10,000 cycles from glibc, musl and Go, TCP
// and UDP), with no SYN retransmitted; every connect to an address no answer
// named, and to the address of a name the policy does not list, is refused with
// EPERM and shown by tap --denied; in audit mode the same connects go through and
// are counted.
func TestEgressGrantsBeforeTheAnswer(t *testing.T) {
	n := newEgressNode(t, map[string]string{"enforced": "enforce/fail-closed", "audited": "audit/fail-open"})
	buildEgressClients(t)
	n.start()

	t.Run("allowed", func(t *testing.T) {
		asked := n.orig.Count(freshName + ".")
		for name, argv := range egressClients(2500, freshName) {
			r := n.connects("enforced", argv...)
			t.Logf("%s: %d cycles, connect after the answer p50 %d µs, p99 %d µs, max %d µs", name, r.Cycles, r.P50, r.P99, r.Max)
			if r.OK != r.Cycles || r.EPERM != 0 || r.Failed != 0 || r.Retrans != 0 {
				t.Errorf("%s: %+v: want every connect through, none denied, no SYN retransmitted; first failures %v", name, r, first(r.Fails, 5))
			}
		}
		// Every cycle's address was new: the upstream answered (nearly) every lookup.
		if got := n.orig.Count(freshName+".") - asked; got < 4*2500*9/10 {
			t.Errorf("the upstream answered %d lookups of %s for 10,000 cycles: the cache served the rest, which the race test must not", got, freshName)
		}
	})
	t.Run("never-resolved", func(t *testing.T) {
		for name, argv := range egressClients(300, "-x", neverPrefix, "unused.test") {
			r := n.connects("enforced", argv...)
			if r.EPERM != r.Cycles {
				t.Errorf("%s: %+v: want every connect to a never-resolved address refused with EPERM", name, r)
			}
		}
	})
	t.Run("not-listed", func(t *testing.T) {
		recs := n.startTap("--denied")
		r := n.connects("enforced", bins.egressGlibc, "-n", "3", "-p", strconv.Itoa(internetPort), unlistedName)
		if r.EPERM != 3 {
			t.Fatalf("%+v: want the connects to a name the policy does not list refused", r)
		}
		want := netip.AddrPortFrom(netip.MustParseAddr(unlistedIP), internetPort).String()
		if !waitRecord(recs, 10*time.Second, func(rec tap.Record) bool {
			return rec.Answer == "denied" && rec.Dst == want && rec.Qname == unlistedName+"."
		}) {
			t.Errorf("tap --denied showed no denied connect to %s naming %s", want, unlistedName)
		}
	})
	t.Run("audit", func(t *testing.T) {
		before := n.metric(`meshdns_egress_connects_total{client_namespace="",client_pod="",verdict="audited",workload="` + n.cgs["audited"].Path + `"}`)
		r := n.connects("audited", bins.egressGlibc, "-n", "200", "-p", strconv.Itoa(internetPort), "-x", neverPrefix, "unused.test")
		if r.OK != 200 || r.EPERM != 0 {
			t.Fatalf("%+v: want every connect through in audit mode", r)
		}
		series := `meshdns_egress_connects_total{client_namespace="",client_pod="",verdict="audited",workload="` + n.cgs["audited"].Path + `"}`
		if !testenv.WaitFor(5*time.Second, func() bool { return n.metric(series)-max(before, 0) >= 200 }) {
			t.Errorf("%s = %v after 200 audited connects (before %v)", series, n.metric(series), before)
		}
	})
}

// TestEgressWhileTheAgentIsKilled: the agent is killed (-9) for 10 s in the
// middle of resolve -> connect load. A fail-open workload is never denied (its
// lookups fail over to the original nameserver, its connects are let through
// while no agent serves); a fail-closed one stays closed: a never-resolved
// address is refused while the agent is away. After the restart both are
// granted again.
func TestEgressWhileTheAgentIsKilled(t *testing.T) {
	n := newEgressNode(t, map[string]string{"open": "enforce/fail-open", "closed": "enforce/fail-closed"})
	buildEgressClients(t)
	n.start()

	var wg sync.WaitGroup
	var during connload.Summary
	wg.Add(1)
	go func() {
		defer wg.Done()
		// About 20 s of cycles against the fail-open workload: the kill and the
		// restart land in the middle.
		during = n.connects("open", bins.egressGlibc, "-n", "40000", "-p", strconv.Itoa(internetPort), freshName)
	}()
	// Kill the agent once the load is well under way.
	if !testenv.WaitFor(30*time.Second, func() bool { return n.inet.Accepted() >= 2000 }) {
		t.Fatalf("the load did not get going: %d connects", n.inet.Accepted())
	}
	n.agent.Kill()
	down := time.Now()
	closed := n.connects("closed", bins.egressGlibc, "-n", "50", "-p", strconv.Itoa(internetPort), "-x", neverPrefix, "unused.test")
	if closed.EPERM != closed.Cycles {
		t.Errorf("fail-closed workload while no agent runs: %+v, want every never-resolved connect refused", closed)
	}
	opened := n.connects("open", bins.egressGlibc, "-n", "50", "-p", strconv.Itoa(internetPort), "-x", neverPrefix, "unused.test")
	if opened.OK != opened.Cycles {
		t.Errorf("fail-open workload while no agent runs: %+v, want every connect through", opened)
	}
	time.Sleep(time.Until(down.Add(10 * time.Second))) // the agent stays away 10 s: the outage under test, not a wait
	n.node.start("ebpf", n.egressArgs()...)
	wg.Wait()
	t.Logf("fail-open workload across the kill: %+v", during)
	if during.EPERM != 0 {
		t.Errorf("fail-open workload across a kill -9 and a restart: %d connects denied (first %v)", during.EPERM, first(during.Fails, 5))
	}
	after := n.connects("closed", bins.egressGlibc, "-n", "500", "-p", strconv.Itoa(internetPort), freshName)
	if after.OK != after.Cycles {
		t.Errorf("fail-closed workload after the restart: %+v (first %v)", after, first(after.Fails, 5))
	}
}

func first(s []string, k int) []string { return s[:min(len(s), k)] }

// buildEgressClients builds the resolve -> connect clients once per test binary.
func buildEgressClients(t *testing.T) {
	t.Helper()
	bins.egressGo = agenttest.GoBinary(t, "./test/e2e/testdata/goegress")
	bins.egressMusl = agenttest.Program(t, "egressload-musl", "musl-gcc", "-static", "-O2", "-o", agenttest.Out, "test/e2e/testdata/egressload/egressload.c")
	bins.egressGlibc = agenttest.Program(t, "egressload-glibc", "gcc", "-O2", "-o", agenttest.Out, "test/e2e/testdata/egressload/egressload.c")
}

// waitRecord reads recs until one matches or d passes.
func waitRecord(recs <-chan tap.Record, d time.Duration, match func(tap.Record) bool) bool {
	deadline := time.After(d)
	for {
		select {
		case r, ok := <-recs:
			if !ok {
				return false
			}
			if match(r) {
				return true
			}
		case <-deadline:
			return false
		}
	}
}
