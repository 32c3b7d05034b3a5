package e2e

import (
	"bufio"
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// startTap runs `meshdns-ebpf tap -o json` with args in the node's namespace,
// as an operator does, waits until the agent counts it as a subscriber and
// returns its records as they arrive.
func (n *node) startTap(args ...string) <-chan tap.Record {
	n.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	argv := append([]string{"tap", "-o", "json", "--state-dir", n.stateDir}, args...)
	cmd := testenv.Command(ctx, testenv.Proc{Netns: n.ns, NetOnly: true}, bins.agent, argv...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		n.t.Fatal(err)
	}
	var stderr testenv.SyncBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	recs := make(chan tap.Record, 1024)
	go func() {
		defer close(recs)
		_ = tap.Read(bufio.NewReader(stdout), func(r *tap.Record) error {
			recs <- *r
			return nil
		})
	}()
	n.t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if n.t.Failed() {
			n.t.Logf("tap stderr: %s", stderr.String())
		}
	})
	if !testenv.WaitFor(10*time.Second, func() bool { return n.metric("meshdns_tap_subscribers") == 1 }) {
		n.t.Fatalf("the tap did not subscribe: %s", stderr.String())
	}
	return recs
}

// metric is the value of an unlabelled (or fully written) series of the
// agent's /metrics, or -1.
func (n *node) metric(series string) float64 {
	_, body := n.httpGet("http://" + adminAddr + "/metrics")
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}

// relCgroup is a cgroup's path from the cgroup2 mount, as the agent names it.
func relCgroup(t *testing.T, cg *testenv.Cgroup) string {
	t.Helper()
	mount, err := cgroup2.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimPrefix(cg.Path, mount)
}

// A query for a name the upstream never answers shows in `tap --unanswered`
// as it fails: within the upstream timeout + 1 s of being sent, as "failed"
// (SERVFAIL), named by the cgroup of the process that sent it (a unit on a
// VM), through the eBPF capture.
func TestTapShowsUnansweredWithItsWorkload(t *testing.T) {
	n := newNode(t)
	n.orig.SetNameSilent("*.blackhole.test")
	n.start("ebpf")
	app := n.cg.Child(t, "app.service")
	recs := n.startTap("--unanswered")

	const name = "q1.blackhole.test"
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	dig := testenv.Command(ctx, testenv.Proc{Netns: n.pod, Cgroup: app, UID: 1000, GID: 1000}, "dig", "+time=8", "+tries=1", name, "A")
	var digOut testenv.SyncBuffer
	dig.Stdout, dig.Stderr = &digOut, &digOut
	sent := time.Now()
	if err := dig.Start(); err != nil {
		t.Fatal(err)
	}
	digDone := make(chan error, 1)
	go func() { digDone <- dig.Wait() }()

	limit := upstream.DefaultTimeout + time.Second
	var got *tap.Record
	timer := time.NewTimer(limit)
	defer timer.Stop()
	for got == nil {
		select {
		case r, ok := <-recs:
			if !ok {
				t.Fatal("the tap stream ended")
			}
			if r.Qname == name+"." {
				got = &r
			} else if r.Lost == 0 {
				t.Errorf("tap --unanswered shows %s (%s %s): only unanswered queries were asked for", r.Qname, r.Answer, r.Rcode)
			}
		case <-timer.C:
			t.Fatalf("%s not in tap --unanswered within %s of sending it (upstream timeout %s + 1 s); upstream saw it %d times; dig: %s",
				name, limit, upstream.DefaultTimeout, n.orig.Count(name), digOut.String())
		}
	}
	took := time.Since(sent)
	t.Logf("%s in the tap %s after it was sent: %s %s latency %.0f µs, workload %s (cgroup %d, pid %d)",
		name, took.Round(time.Millisecond), got.Answer, got.Rcode, got.LatencyUS, got.Workload, got.CgroupID, got.PID)
	want := relCgroup(t, app)
	if got.Answer != "failed" || got.Rcode != "SERVFAIL" || got.Qtype != "A" {
		t.Errorf("record %+v: want answer failed, rcode SERVFAIL, qtype A", *got)
	}
	if got.Workload != want || got.Cgroup != want || got.CgroupID != app.ID(t) || got.By != "cgroup" || got.PID == 0 {
		t.Errorf("sender %q (cgroup %q id %d by %q pid %d), want %s (id %d) by cgroup with its pid", got.Workload, got.Cgroup, got.CgroupID, got.By, got.PID, want, app.ID(t))
	}
	if n.orig.Count(name) == 0 {
		t.Errorf("the upstream never saw %s: it was not forwarded", name)
	}
	select {
	case err := <-digDone:
		if !strings.Contains(digOut.String(), "SERVFAIL") {
			t.Errorf("dig %s: %v, want SERVFAIL:\n%s", name, err, digOut.String())
		}
	case <-ctx.Done():
		t.Errorf("dig %s did not finish", name)
	}
	// The top talkers count it for its workload once the window moves (every 5 s).
	series := fmt.Sprintf(`meshdns_top_workload_unanswered{client_namespace="",client_pod="",workload=%q}`, want)
	if !testenv.WaitFor(15*time.Second, func() bool { return n.metric(series) == 1 }) {
		t.Errorf("%s = %v, want 1", series, n.metric(series))
	}
}
