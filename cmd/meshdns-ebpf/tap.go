package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentclient"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
)

// runTap streams the running agent's answered queries until interrupted.
func runTap(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("tap", stderr)
	stateDir, admin := agentFlags(fs)
	var f tap.Filter
	var qtypes, rcodes, answers string
	fs.StringVar(&f.Namespace, "namespace", "", "queries from pods of this namespace")
	fs.StringVar(&f.Pod, "pod", "", "queries from this pod (a name or a glob: web-*)")
	fs.StringVar(&f.Cgroup, "cgroup", "", "queries from this cgroup or below it (a path from the cgroup2 mount, or a glob: /system.slice/*)")
	fs.StringVar(&f.Suffix, "suffix", "", "query names equal to this name or under it (svc.cluster.local)")
	fs.StringVar(&qtypes, "qtype", "", "query types, comma-separated (A,AAAA)")
	fs.StringVar(&rcodes, "rcode", "", "response codes, comma-separated (NXDOMAIN,SERVFAIL)")
	fs.StringVar(&answers, "answer", "", "where the answer came from, comma-separated: table, autopath, cache, upstream, fallback (stale), shed (refused), failed (timeout), error, throttled (over the workload's budget); denied, audited (egress decisions, see --denied)")
	fs.DurationVar(&f.MinLatency, "min-latency", 0, "answers that took at least this long (50ms)")
	fs.BoolVar(&f.Unanswered, "unanswered", false, "queries that got no answer in time: upstream timeouts and failures, shed load, throttled workloads")
	denied := fs.Bool("denied", false, "egress decisions instead of queries: connects and sends that no grant allowed (denied in enforce mode, audited in audit mode), with the destination and the name it was answered for, if any")
	limit := fs.Int("n", 0, "stop after this many records (0: until interrupted)")
	out := outputFlag(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := checkOutput(*out); err != nil {
		return err
	}
	if *denied {
		if answers != "" {
			return errors.New("tap: --denied and --answer select different records: use one")
		}
		answers = "denied,audited"
	}
	v := f.Values()
	for k, s := range map[string]string{"qtype": qtypes, "rcode": rcodes, "answer": answers} {
		if s != "" {
			v.Set(k, s)
		}
	}
	f, err := tap.ParseFilter(v) // validates the lists
	if err != nil {
		return err
	}
	ep, err := agentclient.AgentEndpoint(*stateDir, *admin)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if *out == "table" {
		fmt.Fprintln(stdout, tap.TextHeader)
	}
	n := 0
	return agentclient.StreamTap(ctx, ep, f, func(r *tap.Record) error {
		var err error
		if *out == "json" {
			err = writeRecordJSON(stdout, r)
		} else {
			err = tap.WriteText(stdout, r)
		}
		if r.Lost == 0 {
			n++
		}
		if *limit > 0 && n >= *limit {
			cancel()
		}
		return err
	})
}

// writeRecordJSON writes r as one line (the agent's own encoding, so
// `tap -o json` is as easy to pipe as the stream itself).
func writeRecordJSON(w io.Writer, r *tap.Record) error {
	if r.Time.IsZero() && r.Lost > 0 {
		_, err := fmt.Fprintf(w, "{\"lost\":%d}\n", r.Lost)
		return err
	}
	r.Time = r.Time.UTC().Round(time.Microsecond)
	return writeJSONLine(w, r)
}
