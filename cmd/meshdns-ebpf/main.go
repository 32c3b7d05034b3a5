// Command meshdns-ebpf is the node DNS interceptor for service meshes: `run` is the
// agent (resolver plus capture datapath); `stats`, `status` and `cleanup` inspect and
// repair a node; `version` prints the build.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/meshdns/meshdns-ebpf/internal/agent"
	"github.com/meshdns/meshdns-ebpf/internal/agentclient"
	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/version"
)

const usage = `meshdns-ebpf: DNS capture for service meshes, at the socket.

Usage:
  meshdns-ebpf run [flags]       run the agent (resolver + capture); -h lists the flags
  meshdns-ebpf stats [flags]     datapath counters per hook, in total and per cgroup
  meshdns-ebpf status [flags]    what is attached where, mode, resolver, readiness, name sources, conntrack
  meshdns-ebpf table [flags]     the running agent's merged name table (-o json, or -o ndsz: Istio's format)
  meshdns-ebpf tap [flags]       a live stream of answered queries: who asked, what, the answer and how long it took
  meshdns-ebpf cleanup [flags]   remove what a crashed agent left (pins, links, rules, addresses)
  meshdns-ebpf probe ready|live [flags]
                                 a kubelet's exec probe, in the agent's container: is this container's agent ready / live
  meshdns-ebpf version
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case errors.Is(err, flag.ErrHelp):
		// -h asked for the usage, which was printed: not an error.
	case err != nil:
		fmt.Fprintln(os.Stderr, "meshdns-ebpf:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("a command is required")
	}
	cmd, args := args[0], args[1:]
	switch cmd {
	case "run":
		return runAgent(ctx, args, stderr)
	case "stats":
		return runStats(args, stdout, stderr)
	case "status":
		return runStatus(args, stdout, stderr)
	case "table":
		return runTable(args, stdout, stderr)
	case "tap":
		return runTap(ctx, args, stdout, stderr)
	case "cleanup":
		return runCleanup(args, stdout, stderr)
	case "probe":
		return runProbe(args, stderr)
	case "version":
		fmt.Fprintln(stdout, "meshdns-ebpf", version.String())
		return nil
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		fmt.Fprint(stderr, usage)
		return fmt.Errorf("unknown command %q", cmd)
	}
}

// flagSetCreated, when set (by tests), sees each command's flag set.
var flagSetCreated func(*flag.FlagSet)

func newFlagSet(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("meshdns-ebpf "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	if flagSetCreated != nil {
		flagSetCreated(fs)
	}
	return fs
}

func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected argument %q", fs.Name(), fs.Arg(0))
	}
	return nil
}

func runAgent(ctx context.Context, args []string, stderr io.Writer) error {
	var cfg agent.Config
	fs := newFlagSet("run", stderr)
	cfg.RegisterFlags(fs)
	if err := parse(fs, args); err != nil {
		return err
	}
	log, err := newLogger(cfg.LogLevel, cfg.LogFormat, stderr)
	if err != nil {
		return err
	}
	a, err := agent.New(cfg, log)
	if err != nil {
		return err
	}
	if err := a.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	return a.Close()
}

func newLogger(level, format string, w io.Writer) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return slog.New(slog.NewTextHandler(w, opts)), nil
}

// outputFlag registers -o table|json.
func outputFlag(fs *flag.FlagSet) *string {
	return fs.String("o", "table", "output format: table or json")
}

func checkOutput(o string) error {
	if o != "table" && o != "json" {
		return fmt.Errorf("-o %q: want table or json", o)
	}
	return nil
}

// tabler is anything the CLI prints as an aligned table.
type tabler interface{ WriteTable(io.Writer) error }

// render prints v as indented JSON for -o json, else as its table.
func render(w io.Writer, format string, v tabler) error {
	if format == "json" {
		return writeJSON(w, v)
	}
	return v.WriteTable(w)
}

// bpffsFlag is --bpffs of stats, status and cleanup: empty means where the
// agent's state file says it pinned, else the default (agentstate.PinDir).
func bpffsFlag(fs *flag.FlagSet) *string {
	return fs.String("bpffs", "", "directory where the agent pinned its links and maps (default: the one its state file records, else "+agentstate.DefaultBPFFS+")")
}

// readFlags are the flags of the commands that read the agent's state:
// stats and status.
type readFlags struct {
	bpffs, stateDir, admin, out *string
}

// parseReadFlags parses the flags of stats or status.
func parseReadFlags(name string, args []string, stderr io.Writer) (readFlags, error) {
	fs := newFlagSet(name, stderr)
	var f readFlags
	f.bpffs = bpffsFlag(fs)
	f.stateDir, f.admin = agentFlags(fs)
	f.out = outputFlag(fs)
	if err := parse(fs, args); err != nil {
		return f, err
	}
	return f, checkOutput(*f.out)
}

func runStats(args []string, stdout, stderr io.Writer) error {
	f, err := parseReadFlags("stats", args, stderr)
	if err != nil {
		return err
	}
	s, err := redirect.ReadStats(agentstate.PinDir(*f.stateDir, *f.bpffs))
	if err != nil {
		return err
	}
	namePods(s, *f.stateDir, *f.admin, stderr)
	return render(stdout, *f.out, s)
}

func runStatus(args []string, stdout, stderr io.Writer) error {
	f, err := parseReadFlags("status", args, stderr)
	if err != nil {
		return err
	}
	return render(stdout, *f.out, agentclient.ReadStatusAt(*f.stateDir, *f.bpffs, *f.admin))
}

func runCleanup(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("cleanup", stderr)
	bpffs := bpffsFlag(fs)
	stateDir := fs.String("state-dir", agentstate.DefaultStateDir, "the agent's state directory")
	if err := parse(fs, args); err != nil {
		return err
	}
	removed, err := agent.Cleanup(*stateDir, *bpffs, slog.New(slog.NewTextHandler(stderr, nil)))
	for _, r := range removed {
		fmt.Fprintln(stdout, "removed", r)
	}
	if len(removed) == 0 && err == nil {
		fmt.Fprintln(stdout, "nothing to clean up")
	}
	return err
}

// runProbe is the DaemonSet's exec probes (agentclient.Probe): exit 0 when the
// check passes, else 1 with the reason.
func runProbe(args []string, stderr io.Writer) error {
	if len(args) == 0 || strings.HasPrefix(args[0], "-") {
		return fmt.Errorf("probe: give the check: %s or %s", agentclient.ProbeReady, agentclient.ProbeLive)
	}
	check, args := args[0], args[1:]
	fs := newFlagSet("probe "+check, stderr)
	stateDir := fs.String("state-dir", agentstate.DefaultStateDir, "the agent's state directory (it holds the agent's local admin socket)")
	if err := parse(fs, args); err != nil {
		return err
	}
	return agentclient.Probe(*stateDir, check)
}
