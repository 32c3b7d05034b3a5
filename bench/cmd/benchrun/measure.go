//go:build linux

package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"time"

	"github.com/meshdns/meshdns-ebpf/bench/internal/dnsperf"
	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
)

// dnsperfVersion is taken from the first dnsperf report.
var dnsperfVersion = "?"

// run is one measured dnsperf run against one server.
type run struct {
	res       dnsperf.Result
	serverCPU time.Duration // server's thread run time during the run
	genBusy   float64       // generator's CPU / wall (sampled while it ran), 0..1 per core
	upstreamQ int64         // queries the fake upstream saw during the run (-1: unknown)
	// coreBusy is each core's busy fraction over the run from /proc/stat
	// (tick-sampled); compared with what the server and dnsperf used, it
	// shows other work on the machine.
	serverCore, genCore float64
}

// otherWork estimates the share of a core used by something other than the
// server (server core) or dnsperf (generator core) during the run; the larger
// of the two. Tick sampling makes it +-0.05; -1 if unknown.
func (r run) otherWork() float64 {
	if r.serverCore < 0 || r.genCore < 0 || r.res.RunTime <= 0 {
		return -1
	}
	return max(r.serverCore-r.serverBusy(), r.genCore-r.genBusy, 0)
}

// serverBusy is the server's CPU over dnsperf's measured run time.
func (r run) serverBusy() float64 {
	if r.res.RunTime <= 0 {
		return 0
	}
	return r.serverCPU.Seconds() / r.res.RunTime
}

// usPerQuery is server CPU µs per completed query.
func (r run) usPerQuery() float64 {
	if r.res.Completed == 0 {
		return 0
	}
	return float64(r.serverCPU.Microseconds()) / float64(r.res.Completed)
}

// dnsperfRun runs dnsperf pinned to genCPU while sampling the server's and its own
// CPU time. serverPID 0 skips server accounting.
func (b *bench) dnsperfRun(ctx context.Context, o dnsperf.Options, serverPID int) (run, error) {
	return b.dnsperfRunIn(ctx, nil, o, serverPID)
}

// dnsperfRunIn is dnsperfRun with a command prefix that must exec (not fork)
// into the rest, e.g. `ip netns exec NS` or a cgroup-joining shell, so the
// sampled PID stays dnsperf's.
func (b *bench) dnsperfRunIn(ctx context.Context, prefix []string, o dnsperf.Options, serverPID int) (run, error) {
	var out run
	argv := append(slices.Clone(prefix), "taskset", "-c", strconv.Itoa(b.cfg.genCPU), "dnsperf")
	argv = append(argv, o.Args()...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	stdout, err := dnsperf.NewOutput(b.logDir)
	if err != nil {
		return out, err
	}
	defer stdout.Close()
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = stdout.File(), &stderr
	var cpu0 time.Duration
	if serverPID != 0 {
		c, err := procstat.CPU(serverPID)
		if err != nil {
			return out, fmt.Errorf("server cpu: %w", err)
		}
		cpu0 = c
	}
	up0 := b.upstreamQueries()
	ticks0, terr := procstat.ReadTicks()
	if err := cmd.Start(); err != nil {
		return out, fmt.Errorf("start dnsperf: %w", err)
	}
	started := time.Now()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var genCPU time.Duration
	var genAt time.Time
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var werr error
wait:
	for {
		select {
		case werr = <-done:
			break wait
		case <-tick.C:
			// dnsperf's worker threads exit (taking their run time with
			// them) just before the process does: keep the largest sample.
			if c, err := procstat.CPU(cmd.Process.Pid); err == nil && c > genCPU {
				genCPU, genAt = c, time.Now()
			}
		}
	}
	out.serverCore, out.genCore = -1, -1
	if ticks1, err := procstat.ReadTicks(); err == nil && terr == nil && serverPID != 0 {
		out.serverCore = ticks1.BusySince(ticks0, b.cfg.serverCPU)
		out.genCore = ticks1.BusySince(ticks0, b.cfg.genCPU)
	}
	if serverPID != 0 {
		c, err := procstat.CPU(serverPID)
		if err != nil {
			return out, fmt.Errorf("server cpu: %w", err)
		}
		out.serverCPU = c - cpu0
	}
	if up0 >= 0 {
		if up1 := b.upstreamQueries(); up1 >= 0 {
			out.upstreamQ = up1 - up0
		}
	} else {
		out.upstreamQ = -1
	}
	if werr != nil {
		return out, fmt.Errorf("dnsperf %v: %w: %s", o.Args(), werr, bytes.TrimSpace(stderr.Bytes()))
	}
	// dnsperf spends its first milliseconds reading the data file; the sampled
	// window covers everything up to the last sample.
	if w := genAt.Sub(started); w > 500*time.Millisecond {
		out.genBusy = genCPU.Seconds() / w.Seconds()
	}
	res, err := stdout.Parse()
	if err != nil {
		return out, fmt.Errorf("dnsperf %v: %w", o.Args(), err)
	}
	out.res = res
	if dnsperfVersion == "?" && res.Version != "" {
		dnsperfVersion = res.Version
	}
	if b.cfg.verbose {
		fmt.Fprintf(os.Stderr, "    dnsperf %v: %.0f qps, lost %d, server %.2f core, gen %.2f core, %.1f µs/q\n",
			o.Args(), res.QPS, res.Lost, out.serverBusy(), out.genBusy, out.usPerQuery())
	}
	return out, nil
}
