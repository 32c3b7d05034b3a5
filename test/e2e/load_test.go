package e2e

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The load of the fault tests: real resolvers (glibc's and musl's getaddrinfo,
// Go's resolver) in a pod of the node, each lookup one A query on a fresh
// socket with one attempt (a lost query is a failed lookup, not hidden by a
// retry), mixing names from the table and forwarded names no cache holds, some
// of them answered by the upstream only after 300 ms.

// loadTargets are name=address pairs; %d makes every lookup a new name.
var loadTargets = []string{
	meshName + "=" + meshIP,
	"ratings.default.svc.cluster.local=240.240.0.14",
	"q%d." + fwdZone + "=" + fwdIP,
	"q%d." + slowZone + "=" + slowIP,
}

// isMesh says whether name is answered by the name table (NXDOMAIN at the
// original nameserver).
func isMesh(name string) bool { return strings.HasSuffix(name, ".svc.cluster.local") }

// addLoadPod adds a pod whose resolv.conf names the original nameserver with
// one attempt of 2 s.
func (n *node) addLoadPod() *testenv.Netns {
	n.t.Helper()
	p := testenv.NewNetns(n.t, "mde-load")
	testenv.Veth(n.t, n.ns, "vload", "169.254.110.1/30", p, "eth0", "169.254.110.2/30")
	p.IP(n.t, "route", "add", "default", "via", "169.254.110.1")
	p.SetResolvConf(n.t, "nameserver "+origNS+"\noptions timeout:2 attempts:1\n")
	return p
}

type loadClient struct {
	*agenttest.Process
	name string
}

type load struct {
	t       *testing.T
	clients []*loadClient
}

// loadFail is one lookup that did not return the expected address.
type loadFail struct {
	client     string
	start, end int64 // CLOCK_MONOTONIC ns
	name, what string
}

type loadResult struct {
	sent, ok, wrong, nx, failed int
	servfail, lost              int               // -raw clients only
	perClient                   map[string]string // client -> its summary line
	fails                       []loadFail
}

func monotonic() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// loadClientSpec is one load client: its binary, share of the rate, extra
// flags and targets (nil: loadTargets).
type loadClientSpec struct {
	name    string
	bin     string
	share   float64
	flags   []string
	targets []string
}

// startLoad runs the three clients in pod, inside the test cgroup (captured),
// as uid 1000, sharing rate lookups per second: glibc 40%, musl 30%, Go 30%.
func (n *node) startLoad(pod *testenv.Netns, rate float64) *load {
	n.t.Helper()
	return n.startLoadClients(pod, rate, []loadClientSpec{
		{name: "glibc", bin: bins.loadGlibc, share: 0.4},
		{name: "musl", bin: bins.loadMusl, share: 0.3},
		{name: "go", bin: bins.loadGo, share: 0.3},
	})
}

func (n *node) startLoadClients(pod *testenv.Netns, rate float64, specs []loadClientSpec) *load {
	n.t.Helper()
	l := &load{t: n.t}
	for _, c := range specs {
		targets := c.targets
		if targets == nil {
			targets = loadTargets
		}
		args := append(append([]string{"-r", fmt.Sprint(rate * c.share), "-t", "64"}, c.flags...), targets...)
		cmd := testenv.Command(context.Background(), testenv.Proc{Netns: pod, Cgroup: n.cg, UID: 1000, GID: 1000}, c.bin, args...)
		lc := &loadClient{name: c.name, Process: agenttest.Start(n.t, cmd, agenttest.Options{Unmanaged: true})}
		l.clients = append(l.clients, lc)
		n.t.Cleanup(lc.Kill)
	}
	for _, c := range l.clients {
		if !c.Log.WaitFor("START", 10*time.Second) {
			n.t.Fatalf("%s load did not start:\n%s", c.name, c.Log.String())
		}
	}
	return l
}

// stop ends the load (lookups in flight finish) and collects what it saw.
func (l *load) stop() loadResult {
	l.t.Helper()
	for _, c := range l.clients {
		_ = c.Signal(syscall.SIGTERM)
	}
	r := loadResult{perClient: map[string]string{}}
	for _, c := range l.clients {
		ok, err := c.Wait(30 * time.Second)
		if !ok {
			l.t.Fatalf("%s load did not stop", c.name)
		}
		if err != nil {
			l.t.Fatalf("%s load: %v\n%s", c.name, err, c.Log.String())
		}
		out := agenttest.ParseLoadOutput(c.Log.String())
		for _, f := range out.Fails {
			r.fails = append(r.fails, loadFail{c.name, f.Start, f.End, f.Name, f.What})
		}
		if out.Summary != "" {
			r.perClient[c.name] = out.Summary
			r.sent += out.Counts["sent"]
			r.ok += out.Counts["ok"]
			r.wrong += out.Counts["wrong"]
			r.nx += out.Counts["nxdomain"]
			r.failed += out.Counts["failed"]
			r.servfail += out.Counts["servfail"]
			r.lost += out.Counts["lost"]
		}
		if _, ok := r.perClient[c.name]; !ok {
			l.t.Fatalf("%s load printed no summary:\n%s", c.name, c.Log.String())
		}
	}
	return r
}

// between returns the failures of lookups started in [from, to).
func (r loadResult) between(from, to int64) []loadFail {
	var out []loadFail
	for _, f := range r.fails {
		if f.start >= from && f.start < to {
			out = append(out, f)
		}
	}
	return out
}

// split sorts failures into mesh names answered NXDOMAIN (the original
// nameserver answered: fell through) and everything else (lost or wrong).
func split(fails []loadFail) (fellThrough, bad []loadFail) {
	for _, f := range fails {
		if f.what == "nxdomain" && isMesh(f.name) {
			fellThrough = append(fellThrough, f)
		} else {
			bad = append(bad, f)
		}
	}
	return fellThrough, bad
}

// byName counts failures per name, for printing.
func byName(fails []loadFail) string {
	c := map[string]int{}
	for _, f := range fails {
		c[f.name]++
	}
	var out []string
	for n, k := range c {
		out = append(out, fmt.Sprintf("%s: %d", n, k))
	}
	sort.Strings(out)
	return strings.Join(out, ", ")
}

// describe lists up to 10 failures.
func describe(fails []loadFail, origin int64) string {
	var b strings.Builder
	for i, f := range fails {
		if i == 10 {
			fmt.Fprintf(&b, "  ... %d more\n", len(fails)-10)
			break
		}
		fmt.Fprintf(&b, "  %s %s: %s (started %v, took %v)\n", f.client, f.name, f.what,
			time.Duration(f.start-origin).Round(time.Millisecond), time.Duration(f.end-f.start).Round(time.Millisecond))
	}
	return b.String()
}

// mapMiss is the datapath's count of replies from a resolver slot to a socket
// with no state for it: a reply the kernel hands over with the wrong source.
func (n *node) mapMiss() uint64 {
	n.t.Helper()
	return hookCounter(n.t, n, "recvmsg4", "map_miss") + hookCounter(n.t, n, "recvmsg6", "map_miss") +
		hookCounter(n.t, n, "getpeername4", "map_miss") + hookCounter(n.t, n, "getpeername6", "map_miss")
}

// TestLoadClientsNameEveryWrongAddress: the load clients print the address of
// every wrong answer whole, however many threads report at once. The node and
// rollout tests tell an answer of the original nameserver (allowed while no
// agent runs) from a wrong one by that address.
func TestLoadClientsNameEveryWrongAddress(t *testing.T) {
	n := newNode(t)
	pod := n.addLoadPod()
	// No agent: the original nameserver answers fwdIP, which the target does not expect.
	const want = 40_000 // wrong answers reported, all clients together
	targets := []string{"q%d." + fwdZone + "=169.254.77.1"}
	l := n.startLoadClients(pod, 8_000, []loadClientSpec{
		{name: "glibc", bin: bins.loadGlibc, share: 0.5, targets: targets},
		{name: "musl", bin: bins.loadMusl, share: 0.5, targets: targets},
	})
	testenv.Eventually(t, 2*time.Minute, func() bool {
		reported := 0
		for _, c := range l.clients {
			reported += strings.Count(c.Log.String(), "\nFAIL ")
		}
		return reported >= want
	}, "the load clients did not report %d wrong answers in 2 min", want)
	res := l.stop()
	var garbled []loadFail
	for _, f := range res.fails {
		if f.what != "wrong:"+fwdIP {
			garbled = append(garbled, f)
		}
	}
	t.Logf("%d lookups, %d reported wrong: %s", res.sent, len(res.fails), res.perClient)
	if len(res.fails) != res.wrong || len(garbled) > 0 {
		t.Errorf("%d of %d wrong answers were not reported as wrong:%s (summaries count %d):\n%s",
			len(garbled), len(res.fails), fwdIP, res.wrong, describe(garbled, 0))
	}
}
