package node

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
)

// The load of the rollout and restart checks: 2,000 lookups/s from the client
// pods, each lookup one A query of an FQDN (no search list) with one attempt of
// 2 s (the pods' dnsConfig), so a lost query is a failed lookup and not hidden
// by a retry. Every lookup is judged by its answer:
//
//   - agent: the expected address (only the agent's table and upstream know it);
//   - original: nodetest.Marker, what the stand-in cluster DNS answers for every
//     name (the lookup went around the agent);
//   - lost: no answer (timeout, refused);
//   - wrongsrc: a reply from another address than the one asked (only the raw
//     Go client, on an unconnected socket, can see it; glibc, musl and Go's
//     resolver drop such replies, which then count as lost);
//   - wrong: any other answer (NXDOMAIN from the agent, another address).
//
// The clients print every lookup that was not answered by the agent with its
// start time on CLOCK_MONOTONIC, which is the same clock in every pod, so each
// check counts the lookups started in its own window.

// loadClient is one load generator: a pod and its command, at a share of the rate.
type loadClient struct {
	name, ns, pod string
	argv          []string // before the rate flags
	share         float64
	raw           bool
}

// loadClients are glibc 40%, musl 30%, Go's resolver 15% and the raw Go client
// (wrong-source detector) 15%.
func loadClients() []loadClient {
	return []loadClient{
		{name: "glibc", ns: "team-a", pod: "glibc", argv: []string{"dnsload", "-i"}, share: 0.4},
		{name: "musl", ns: "team-a", pod: "musl", argv: []string{"dnsload", "-i"}, share: 0.3},
		{name: "go", ns: "team-b", pod: "go", argv: []string{"goload", "-i"}, share: 0.15},
		{name: "go-raw", ns: "team-b", pod: "go", argv: []string{"goload", "-i", "-raw", "-unconnected",
			"-server", nodetest.ClusterDNS + ":53", "-timeout", "2s"}, share: 0.15, raw: true},
	}
}

type runningClient struct {
	*agenttest.Process
	c     loadClient
	stdin io.WriteCloser
}

// load is the running load.
type load struct {
	t       *testing.T
	clients []*runningClient
	started int64
}

// lookup is one lookup not answered by the agent.
type lookup struct {
	client     string
	start, end int64
	name, what string
}

// loadResult is what the clients reported.
type loadResult struct {
	sent      map[string]int // per client
	failures  []lookup
	summaries map[string]string
}

func monotonic() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// startLoad starts every client at its share of rate lookups per second.
func startLoad(t *testing.T, n *nodetest.Node, rate float64, targets []string) *load {
	t.Helper()
	l := &load{t: t, started: monotonic()}
	for _, c := range loadClients() {
		// One thread per lookup/s, up to 64: a low rate keeps its even spacing.
		r := rate * c.share
		threads := min(64, max(1, int(r)))
		args := append([]string{"exec", "-i", "-n", c.ns, c.pod, "--"}, c.argv...)
		args = append(append(args, "-t", strconv.Itoa(threads), "-r", strconv.FormatFloat(r, 'f', 1, 64)), targets...)
		cmd := n.KubectlCommand(context.Background(), args...)
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		// Closing stdin stops it (kubectl exec -i); the cleanup kills it if
		// that did not.
		rc := &runningClient{c: c, stdin: stdin, Process: agenttest.Start(t, cmd, agenttest.Options{Unmanaged: true})}
		t.Cleanup(func() {
			_ = stdin.Close()
			if ok, _ := rc.Wait(30 * time.Second); !ok {
				rc.Kill()
			}
		})
		l.clients = append(l.clients, rc)
	}
	for _, rc := range l.clients {
		if !rc.Log.WaitFor("START", 30*time.Second) {
			t.Fatalf("the %s load did not start:\n%s", rc.c.name, rc.Log.String())
		}
	}
	return l
}

// stop ends the load (lookups in flight finish) and parses what it printed.
func (l *load) stop() loadResult {
	l.t.Helper()
	for _, rc := range l.clients {
		_ = rc.stdin.Close()
	}
	r := loadResult{sent: map[string]int{}, summaries: map[string]string{}}
	for _, rc := range l.clients {
		ok, err := rc.Wait(60 * time.Second)
		if !ok {
			l.t.Fatalf("the %s load did not stop", rc.c.name)
		}
		if err != nil {
			l.t.Errorf("the %s load: %v\n%s", rc.c.name, err, tail(rc.Log.String(), 20))
		}
		out := agenttest.ParseLoadOutput(rc.Log.String())
		for _, f := range out.Fails {
			r.failures = append(r.failures, lookup{rc.c.name, f.Start, f.End, f.Name, f.What})
		}
		if out.Summary != "" {
			r.summaries[rc.c.name] = out.Summary
			r.sent[rc.c.name] = out.Counts["sent"]
		}
		if _, ok := r.summaries[rc.c.name]; !ok {
			l.t.Errorf("the %s load printed no summary:\n%s", rc.c.name, tail(rc.Log.String(), 20))
		}
	}
	return r
}

// outcome sorts a reported lookup: original (the marker address), wrongsrc,
// wrong (NXDOMAIN or another address) or lost (everything that is no answer:
// glibc's and musl's EAI_AGAIN, Go's timeouts and refusals, the raw client's
// lost and SERVFAIL).
func outcome(what string) string {
	switch {
	case strings.Contains(what, nodetest.Marker):
		return "original"
	case strings.HasPrefix(what, "wrongsrc:"):
		return "wrongsrc"
	case what == "nxdomain" || strings.HasPrefix(what, "wrong:"):
		return "wrong"
	default:
		return "lost"
	}
}

// tally counts the outcomes of the lookups started in [from, to).
type tally struct {
	sent                            int // all lookups of the whole load run
	original, lost, wrongsrc, wrong int
	bad, orig                       []lookup // a few examples: lost, wrong source or wrong; original
}

func (r loadResult) between(from, to int64) tally {
	var tl tally
	for _, s := range r.sent {
		tl.sent += s
	}
	for _, f := range r.failures {
		if f.start < from || f.start >= to {
			continue
		}
		kind := outcome(f.what)
		switch kind {
		case "original":
			tl.original++
		case "lost":
			tl.lost++
		case "wrongsrc":
			tl.wrongsrc++
		default:
			tl.wrong++
		}
		switch {
		case kind == "original":
			if len(tl.orig) < 3 {
				tl.orig = append(tl.orig, f)
			}
		case kind != "lost":
			tl.bad = append(tl.bad, f) // every wrong source and wrong answer: each is a failure
		case len(tl.bad) < 8:
			tl.bad = append(tl.bad, f)
		}
	}
	return tl
}

func (tl tally) String() string {
	return fmt.Sprintf("%d lookups; %d lost, %d answered by the original nameserver, %d replies from a wrong source, %d wrong answers",
		tl.sent, tl.lost, tl.original, tl.wrongsrc, tl.wrong)
}

// describe lists the examples (lost, wrong source and wrong first) with their
// start relative to origin.
func (tl tally) describe(origin int64) string {
	var b strings.Builder
	for _, f := range append(append([]lookup{}, tl.bad...), tl.orig...) {
		fmt.Fprintf(&b, "  %s %s: %s (started %v, took %v)\n", f.client, f.name, f.what,
			time.Duration(f.start-origin).Round(time.Millisecond), time.Duration(f.end-f.start).Round(time.Millisecond))
	}
	return b.String()
}

// lastStart is the latest start among the lookups of outcome kind started in
// [from, to); 0 when none.
func (r loadResult) lastStart(kind string, from, to int64) int64 {
	var last int64
	for _, f := range r.failures {
		if f.start >= from && f.start < to && outcome(f.what) == kind && f.start > last {
			last = f.start
		}
	}
	return last
}

// perClient is each client's summary line, sorted.
func (r loadResult) perClient() string {
	var out []string
	for c, s := range r.summaries {
		out = append(out, c+": "+s)
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
