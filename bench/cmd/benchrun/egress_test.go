//go:build linux

package main

import (
	"strings"
	"testing"
	"time"
)

// The egress lane judges each of the targets on its own, on (b)'s runs
// (and (a)'s for the CPU), and a target whose runs did not happen fails.
func TestEgressTargets(t *testing.T) {
	tcp := func(conf, client string, cycles, ok, eperm, retrans, p99 int, cpu time.Duration) connectRun {
		return connectRun{conf: conf, client: client, proto: "tcp", cycles: cycles, ok: ok, eperm: eperm, retrans: retrans, p99: p99, cpu: cpu}
	}
	good := func() []connectRun {
		return []connectRun{
			tcp("a", "glibc", 1000, 1000, 0, 0, 300, 200*time.Millisecond),
			tcp("a", "go", 1000, 1000, 0, 0, 400, 600*time.Millisecond),
			tcp("b", "glibc", 1000, 1000, 0, 0, 350, 205*time.Millisecond),
			tcp("b", "go", 1000, 1000, 0, 0, 900, 615*time.Millisecond),
			{conf: "b", client: "musl", proto: "udp", cycles: 100, ok: 100},
			{conf: "b", client: "musl", proto: "tcp", never: true, cycles: 300, eperm: 300},
		}
	}
	for _, tc := range []struct {
		name   string
		change func([]connectRun) []connectRun
		want   [4]bool
	}{
		{"all met", func(r []connectRun) []connectRun { return r }, [4]bool{true, true, true, true}},
		{"one false deny over UDP", func(r []connectRun) []connectRun { r[4].ok, r[4].eperm = 99, 1; return r }, [4]bool{false, true, true, true}},
		{"one false deny over TCP", func(r []connectRun) []connectRun { r[2].ok, r[2].eperm = 999, 1; return r }, [4]bool{false, false, true, false}},
		{"a deny in (a) is no false deny of (b)", func(r []connectRun) []connectRun { r[0].ok, r[0].eperm = 999, 1; return r }, [4]bool{true, true, true, false}},
		{"p99 1 ms in one run", func(r []connectRun) []connectRun { r[3].p99 = 1000; return r }, [4]bool{true, false, true, true}},
		{"one SYN retransmit", func(r []connectRun) []connectRun { r[2].retrans = 1; return r }, [4]bool{true, false, true, true}},
		{"one never-resolved connect through", func(r []connectRun) []connectRun { r[5].ok, r[5].eperm = 1, 299; return r }, [4]bool{true, true, false, true}},
		{"no never-resolved run", func(r []connectRun) []connectRun { return r[:5] }, [4]bool{true, true, false, true}},
		{"CPU 6% more", func(r []connectRun) []connectRun {
			r[2].cpu, r[3].cpu = 212*time.Millisecond, 636*time.Millisecond
			return r
		}, [4]bool{true, true, true, false}},
		{"no run of (b)", func(r []connectRun) []connectRun { return r[:2] }, [4]bool{false, false, false, false}},
	} {
		got := egressTargets(egressReport{runs: tc.change(good())})
		if len(got) != 4 {
			t.Fatalf("%s: %d targets, want 4", tc.name, len(got))
		}
		for i, g := range got {
			if g.ok != tc.want[i] {
				t.Errorf("%s: %q (%s): pass %v, want %v", tc.name, g.name, g.measured, g.ok, tc.want[i])
			}
		}
	}
	if m := egressTargets(egressReport{runs: good()})[3].measured; !strings.Contains(m, "ratio 1.025") {
		t.Errorf("CPU target says %q, want the ratio 820/800 µs = 1.025", m)
	}
}

// A client's output is its FAIL lines and SUMMARY, then helper rusage's line.
func TestParseConnectRun(t *testing.T) {
	out := "FAIL 3 198.18.0.9 eperm\nFAIL 7 198.18.0.12 timeout\n" +
		"SUMMARY cycles=10 ok=8 eperm=1 failed=1 retrans=2 p50_us=70 p99_us=300 max_us=450\n" +
		"RUSAGE cpu_ns=2500000 user_ns=1000000 sys_ns=1500000\n"
	var r connectRun
	if err := parseEgressRun(out, &r); err != nil {
		t.Fatal(err)
	}
	want := connectRun{cycles: 10, ok: 8, eperm: 1, failed: 1, retrans: 2, p50: 70, p99: 300, max: 450, cpu: 2500 * time.Microsecond,
		fails: []string{"3 198.18.0.9 eperm", "7 198.18.0.12 timeout"}}
	if r.cycles != want.cycles || r.ok != want.ok || r.eperm != want.eperm || r.failed != want.failed || r.retrans != want.retrans ||
		r.p50 != want.p50 || r.p99 != want.p99 || r.max != want.max || r.cpu != want.cpu || strings.Join(r.fails, "|") != strings.Join(want.fails, "|") {
		t.Fatalf("parsed %+v, want %+v", r, want)
	}
	if err := parseEgressRun("SUMMARY cycles=10 ok=10\n", &r); err == nil {
		t.Fatal("output without the RUSAGE line parsed")
	}
}

// The CPU ratio of each round pairs the two configurations' runs of that round.
func TestEgressRoundRatios(t *testing.T) {
	run := func(conf string, round int, cpu time.Duration) connectRun {
		return connectRun{conf: conf, client: "glibc", proto: "tcp", round: round, cycles: 100, ok: 100, cpu: cpu}
	}
	rep := egressReport{runs: []connectRun{
		run("a", 1, 10*time.Millisecond), run("b", 1, 11*time.Millisecond),
		run("b", 2, 20*time.Millisecond), run("a", 2, 20*time.Millisecond),
		{conf: "b", proto: "tcp", never: true, round: 2, cycles: 100, eperm: 100, cpu: time.Second},
	}}
	got := rep.roundRatios()
	if len(got) != 2 || got[0] < 1.099 || got[0] > 1.101 || got[1] != 1 {
		t.Fatalf("round ratios %v, want [1.1 1] (the never-resolved run left out)", got)
	}
}
