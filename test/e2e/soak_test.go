package e2e

import (
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// soakEnv turns the soak on and sets its length (`make soak`: 10m). It is not
// part of `make test`.
const soakEnv = "MESHDNS_SOAK"

// flakyZone's upstream answers normally, then slowly, then not at all, in turn.
const (
	flakyZone = "flaky.test"
	flakyIP   = "169.254.77.10"
)

// TestSoak (`make soak`): mixed load for MESHDNS_SOAK (10 minutes)
// while the upstream misbehaves (a zone answered normally, after 800 ms, or
// never, in turn), the name table is rewritten and the agent restarts every
// 30 s (an overlapped upgrade and a plain restart in turn). No query may be
// lost; the agent's memory must stay flat (RSS printed at start, peak, end).
func TestSoak(t *testing.T) {
	length := os.Getenv(soakEnv)
	if length == "" {
		t.Skipf("the soak runs with `make soak` (%s=10m); not part of make test", soakEnv)
	}
	dur, err := time.ParseDuration(length)
	if err != nil {
		t.Fatalf("%s=%q: %v", soakEnv, length, err)
	}
	n := newNode(t)
	n.orig.Set("*."+flakyZone, netip.MustParseAddr(flakyIP))
	pod := n.addLoadPod()
	n.start("ebpf")
	missBefore := n.mapMiss()
	stalledBefore, noResolverBefore := hookCounter(t, n, "total", "skip_stalled"), hookCounter(t, n, "total", "skip_no_resolver")
	// glibc and musl cannot tell SERVFAIL (a failing upstream) from no answer:
	// they ask for table names only. The raw client asks for everything and
	// tells them apart: SERVFAIL is an answer, silence is loss. It waits longer
	// than the resolver's upstream budget (upstream.DefaultTimeout), after which
	// a failing upstream's query gets its SERVFAIL.
	meshOnly := loadTargets[:2]
	rawTimeout := (upstream.DefaultTimeout + 2*time.Second).String()
	ld := n.startLoadClients(pod, 1000, []loadClientSpec{
		{name: "glibc", bin: bins.loadGlibc, share: 0.3, targets: meshOnly},
		{name: "musl", bin: bins.loadMusl, share: 0.3, targets: meshOnly},
		{name: "raw", bin: bins.loadGo, share: 0.4, flags: []string{"-raw", "-server", origNS + ":53", "-timeout", rawTimeout},
			targets: append(append([]string{}, loadTargets...), "q%d."+flakyZone+"="+flakyIP)},
	})

	sk := &soak{t: t, n: n}
	start := time.Now()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for sec := 1; time.Since(start) < dur; sec++ {
		<-tick.C
		sk.sample()
		sk.step(sec)
	}
	n.orig.SetNameDelay("*."+flakyZone, 0)
	res := ld.stop()
	el := time.Since(start)
	miss := n.mapMiss() - missBefore
	stalled := hookCounter(t, n, "total", "skip_stalled") - stalledBefore
	noResolver := hookCounter(t, n, "total", "skip_no_resolver") - noResolverBefore

	lost, wrong, fell, servfail := sk.classify(res.fails)
	first, peak, last := sk.rss()
	t.Logf("soak %v: %d lookups (%.0f/s) through %d overlapped upgrades, %d plain restarts, %d table reloads and upstream faults every 30 s",
		el.Round(time.Second), res.sent, float64(res.sent)/el.Seconds(), sk.upgrades, sk.restarts, sk.reloads)
	t.Logf("soak: %d lost, %d wrong, %d wrong-source replies; %d SERVFAIL while the upstream failed (%s); %d mesh lookups answered by the original nameserver during plain restarts",
		len(lost), len(wrong), miss, len(servfail), byZone(servfail), len(fell))
	t.Logf("soak: redirects skipped as stalled %d, for no resolver %d (plain restarts)", stalled, noResolver)
	t.Logf("soak: agent RSS start %.1f MiB, peak %.1f MiB, end %.1f MiB (%d samples, one per second, over %d agent processes)",
		float64(first)/1024, float64(peak)/1024, float64(last)/1024, len(sk.samples), sk.upgrades+sk.restarts+1)
	t.Logf("soak clients: glibc: %s; musl: %s; raw: %s", res.perClient["glibc"], res.perClient["musl"], res.perClient["raw"])
	if len(lost)+len(wrong) > 0 || miss > 0 {
		t.Errorf("soak: %d lost, %d wrong, %d wrong-source; after: %v\n%s%s", len(lost), len(wrong), miss,
			sk.after(append(append([]loadFail{}, lost...), wrong...)), describe(lost, 0), describe(wrong, 0))
	}
	if peak > 2*first+64*1024 {
		t.Errorf("agent RSS grew: start %d KiB, peak %d KiB", first, peak)
	}
}

// soak is what TestSoak does every second, and what it saw.
type soak struct {
	t                           *testing.T
	n                           *node
	samples                     []rssSample
	restarts, upgrades, reloads int
	gaps                        [][2]int64 // plain restarts: from SIGTERM to serving again
	events                      []soakEvent
}

// rssSample is the agent's resident memory (KiB) at one second.
type rssSample struct{ kb, pid int }

// soakEvent is a fault or change the soak made, at a CLOCK_MONOTONIC time.
type soakEvent struct {
	at   int64
	what string
}

func (sk *soak) mark(what string) { sk.events = append(sk.events, soakEvent{monotonic(), what}) }

func (sk *soak) sample() {
	if sk.n.agent == nil {
		return
	}
	if kb := vmRSS(sk.n.agent.Pid()); kb > 0 {
		sk.samples = append(sk.samples, rssSample{kb, sk.n.agent.Pid()})
	}
}

// step makes second sec's change of each 30 s cycle: the upstream slow at
// 5, down at 10, well again and the table reloaded at 15, and the agent
// upgraded (odd cycles) or restarted (even ones) at 0.
func (sk *soak) step(sec int) {
	n, t := sk.n, sk.t
	switch sec % 30 {
	case 5:
		sk.mark("upstream slow")
		n.orig.SetNameDelay("*."+flakyZone, 800*time.Millisecond) // slow
	case 10:
		sk.mark("upstream down")
		n.orig.SetNameDelay("*."+flakyZone, 10*time.Second) // down: answers long after anyone waits
	case 15:
		n.orig.SetNameDelay("*."+flakyZone, 0)
		n.orig.Reset() // its query log would grow for the whole soak
		sk.reloads++
		short := fmt.Sprintf("soak-%d", sk.reloads)
		sk.mark("table reload " + short)
		n.writeNames(short)
		// The reload takes: the new name resolves through capture.
		if !testenv.WaitFor(5*time.Second, func() bool {
			out, _ := n.client(n.ns, 1000, "dig", "+short", "+time=1", "+tries=1", short+".default.svc.cluster.local")
			return strings.TrimSpace(out) == "240.240.0.99"
		}) {
			t.Errorf("table reload %d did not take within 5 s", sk.reloads)
		}
	case 0:
		if (sec/30)%2 == 1 {
			sk.mark("overlapped upgrade")
			n.upgrade("ebpf")
			sk.upgrades++
		} else {
			from := monotonic()
			sk.mark("plain restart")
			if err := n.signal(syscall.SIGTERM); err != nil {
				t.Fatalf("restart: agent exit: %v", err)
			}
			n.startNoWait("ebpf")
			n.waitAnswering(n.agent)
			sk.gaps = append(sk.gaps, [2]int64{from, monotonic()})
			sk.restarts++
		}
	}
}

// inGap: a lookup that began up to a second before a plain restart's stop
// may send its query after capture went off.
func (sk *soak) inGap(f loadFail) bool {
	for _, g := range sk.gaps {
		if f.start >= g[0]-int64(time.Second) && f.start < g[1]+int64(time.Second) {
			return true
		}
	}
	return false
}

// classify sorts the failed lookups: lost, wrong, fallen through to the
// original nameserver during a plain restart, and SERVFAIL of the raw client
// (an answer: the upstream failed).
func (sk *soak) classify(fails []loadFail) (lost, wrong, fell, servfail []loadFail) {
	for _, f := range fails {
		switch {
		case f.what == "lost" || f.what == "again" || strings.HasPrefix(f.what, "eai:"):
			lost = append(lost, f)
		case f.what == "servfail" && f.client == "raw":
			servfail = append(servfail, f)
		case f.what == "nxdomain" && isMesh(f.name) && sk.inGap(f):
			fell = append(fell, f)
		default:
			wrong = append(wrong, f)
		}
	}
	return lost, wrong, fell, servfail
}

// rss is the agent's resident memory (KiB) at the first sample, the peak
// and the last.
func (sk *soak) rss() (first, peak, last int) {
	for i, s := range sk.samples {
		if i == 0 {
			first = s.kb
		}
		peak = max(peak, s.kb)
		last = s.kb
	}
	return first, peak, last
}

// after counts the failures by the event each followed (and how long after).
func (sk *soak) after(fails []loadFail) map[string]int {
	after := map[string]int{}
	for _, f := range fails {
		last := "start"
		var since int64
		for _, e := range sk.events {
			if e.at <= f.start {
				last, since = e.what, f.start-e.at
			}
		}
		after[fmt.Sprintf("%s (+%v)", last, time.Duration(since).Round(100*time.Millisecond))]++
	}
	return after
}

// byZone counts failures per zone (the name without its first label).
func byZone(fails []loadFail) string {
	z := make([]loadFail, len(fails))
	for i, f := range fails {
		z[i] = f
		if _, zone, ok := strings.Cut(f.name, "."); ok && strings.HasPrefix(f.name, "q") {
			z[i].name = zone
		}
	}
	return byName(z)
}

// vmRSS is the resident set of pid in KiB (0 if unknown).
func vmRSS(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.Atoi(f[1])
			return kb
		}
	}
	return 0
}

// writeNames rewrites the name table with one more Service, short (a reload).
func (n *node) writeNames(short string) {
	n.t.Helper()
	y := namesYAML + "  " + short + ".default.svc.cluster.local:\n    ips: [\"240.240.0.99\"]\n    registry: Kubernetes\n    shortname: " + short + "\n    namespace: default\n"
	tmp := n.names + ".tmp"
	if err := os.WriteFile(tmp, []byte(y), 0o644); err != nil {
		n.t.Fatal(err)
	}
	if err := os.Rename(tmp, n.names); err != nil {
		n.t.Fatal(err)
	}
}
