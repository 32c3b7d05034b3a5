package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"

	"github.com/meshdns/meshdns-ebpf/internal/agentclient"
	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/nameview"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// agentFlags registers how the CLI finds the running agent: its state
// directory (which holds its local admin socket), or an admin address.
func agentFlags(fs *flag.FlagSet) (stateDir, admin *string) {
	stateDir = fs.String("state-dir", agentstate.DefaultStateDir, "the agent's state directory (it holds the agent's local admin socket)")
	admin = fs.String("admin", "", "an admin address ADDR:PORT of the agent that serves the debug endpoints: a loopback one (default: the local socket in the state directory; an agent in --mode off has none)")
	return stateDir, admin
}

// runTable lists the running agent's merged name table.
func runTable(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("table", stderr)
	stateDir, admin := agentFlags(fs)
	var f nameview.Filter
	fs.StringVar(&f.Name, "name", "", "names containing this, or matching it as a glob (*.example.com)")
	fs.StringVar(&f.Namespace, "namespace", "", "hosts of objects (Services, ServiceEntries) of this namespace")
	fs.StringVar(&f.Source, "source", "", "hosts of this source, or sources matching a glob (kubernetes, serviceentries, cluster/*, file)")
	fs.StringVar(&f.Client, "client-namespace", "", "what a client pod of this namespace gets: per name the first entry it sees (with -o ndsz: the view of that namespace; default a client of unknown namespace)")
	out := fs.String("o", "table", "output format: table, json, or ndsz (Istio's NameTable JSON, as istiod's /debug/ndsz)")
	if err := parse(fs, args); err != nil {
		return err
	}
	switch *out {
	case "table", "json", "ndsz":
	default:
		return fmt.Errorf("-o %q: want table, json or ndsz", *out)
	}
	ep, err := agentclient.AgentEndpoint(*stateDir, *admin)
	if err != nil {
		return err
	}
	if *out == "ndsz" {
		nt, err := agentclient.ReadNDS(ep, f.Client)
		if err != nil {
			return err
		}
		return writeJSON(stdout, nt)
	}
	entries, err := agentclient.ReadTable(ep, f)
	if err != nil {
		return err
	}
	if *out == "json" {
		if entries == nil {
			entries = []nameview.Entry{}
		}
		return writeJSON(stdout, entries)
	}
	return nameview.WriteTable(stdout, entries)
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// writeJSONLine writes v as JSON on one line.
func writeJSONLine(w io.Writer, v any) error { return json.NewEncoder(w).Encode(v) }

// namePods names the pod of each cgroup from the Pods of this node the
// agent knows. Without an agent (or one without a Kubernetes source) the
// paths stay; that is only worth a note when the address was given.
func namePods(s *redirect.Stats, stateDir, admin string, stderr io.Writer) {
	ep, err := agentclient.AgentEndpoint(stateDir, admin)
	if err != nil {
		return
	}
	pods, err := agentclient.ReadPods(ep)
	if err != nil {
		if admin != "" {
			fmt.Fprintln(stderr, "note: pods not named:", err)
		}
		return
	}
	agentclient.NamePods(s, pods)
}
