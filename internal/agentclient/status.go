package agentclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/egressctl"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// Status is what `meshdns-ebpf status` shows: the agent's own account (state file),
// whether it is alive and ready, what the kernel has attached, and conntrack.
type Status struct {
	Agent     *agentstate.State       `json:"agent,omitempty"`
	Running   bool                    `json:"running"`
	Ready     string                  `json:"ready"` // "yes", or why not
	Datapath  *redirect.Status        `json:"datapath,omitempty"`
	Conntrack *ctzone.ConntrackStatus `json:"conntrack,omitempty"`
	Errors    []string                `json:"errors,omitempty"`
	// Sources are the agent's name sources and their sync state.
	Sources []names.SourceStatus `json:"sources,omitempty"`
	// Egress is DNS-gated egress (an agent with --egress).
	Egress *egressctl.Status `json:"egress,omitempty"`
}

// ReadStatus gathers the status; what cannot be read is reported in Errors.
// pinDir "" means agentstate.PinDir's choice.
func ReadStatus(stateDir, pinDir string) *Status {
	s := &Status{Ready: "no agent state"}
	st, err := agentstate.Read(stateDir)
	running, lerr := agentstate.Locked(stateDir)
	if lerr != nil {
		s.Errors = append(s.Errors, lerr.Error())
	}
	s.Running = running
	switch {
	case err == nil:
		s.Agent = st
		s.Ready = probeReady(stateDir, st, running)
	case errors.Is(err, os.ErrNotExist):
		s.Errors = append(s.Errors, fmt.Sprintf("no agent state in %s: the agent is not running (or stopped cleanly)", stateDir))
	default:
		s.Errors = append(s.Errors, err.Error())
	}
	if ds, err := redirect.ReadStatus(agentstate.PinDir(stateDir, pinDir)); err == nil {
		s.Datapath = ds
	} else if s.Agent == nil || s.Agent.Mode == agentstate.ModeEBPF {
		s.Errors = append(s.Errors, err.Error())
	}
	if ct, err := ctzone.ReadConntrackStatus(); err == nil {
		s.Conntrack = ct
	} else {
		s.Errors = append(s.Errors, "conntrack: "+err.Error())
	}
	if s.Agent != nil && s.Running {
		if e, err := AgentEndpoint(stateDir, ""); err == nil {
			s.readSourcesInto(e)
			s.readEgressInto(e)
		}
	}
	return s
}

func probeReady(stateDir string, st *agentstate.State, running bool) string {
	if !running {
		return fmt.Sprintf("no: agent pid %d is not running (it holds no lock)", st.PID)
	}
	e, err := AgentEndpoint(stateDir, "")
	if err != nil {
		return "unknown: " + err.Error()
	}
	return readyAt(e)
}

// WriteTable prints the status for people.
func (s *Status) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	if a := s.Agent; a != nil {
		fmt.Fprintln(tw, "AGENT\tVALUE")
		fmt.Fprintf(tw, "pid\t%d (running: %v)\n", a.PID, s.Running)
		if a.Predecessor != 0 {
			fmt.Fprintf(tw, "took over from\tpid %d\n", a.Predecessor)
		}
		fmt.Fprintf(tw, "mode\t%s (%s)\n", a.Mode, a.ModeReason)
		fmt.Fprintf(tw, "ready\t%s\n", s.Ready)
		fmt.Fprintf(tw, "resolver\t%s\n", strings.Join(a.Listen, ", "))
		fmt.Fprintf(tw, "nameservers\t%s (capture-all: %v)\n", strings.Join(a.Nameservers, ", "), a.CaptureAll)
		fmt.Fprintf(tw, "upstreams\t%s\n", strings.Join(a.Upstreams, ", "))
		if a.Cgroup != "" {
			fmt.Fprintf(tw, "cgroup\t%s\n", a.Cgroup)
		}
		if a.BPFFSMount != "" {
			fmt.Fprintf(tw, "bpffs mount\t%s\n", a.BPFFSMount)
		}
		if a.Backend != "" {
			fmt.Fprintf(tw, "iptables backend\t%s\n", a.Backend)
		}
		fmt.Fprintf(tw, "admin\t%s\n", a.Admin)
		if a.Local != "" {
			fmt.Fprintf(tw, "local admin socket\t%s\n", a.Local)
		}
		fmt.Fprintf(tw, "started\t%s\n", a.Started.Format(time.RFC3339))
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if s.Datapath != nil {
		if err := s.Datapath.WriteText(w); err != nil {
			return err
		}
		fmt.Fprintln(w)
	}
	if s.Conntrack != nil {
		if err := s.Conntrack.WriteTable(w); err != nil {
			return err
		}
	}
	if err := s.writeMesh(w); err != nil {
		return err
	}
	if s.Egress != nil {
		fmt.Fprintln(w)
		if err := s.Egress.WriteTable(w); err != nil {
			return err
		}
	}
	for _, e := range s.Errors {
		fmt.Fprintln(w, "note:", e)
	}
	return nil
}

// writeSources prints the name sources and their state.
func writeSources(w io.Writer, srcs []names.SourceStatus) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SOURCE\tPRIORITY\tSYNCED\tOBJECTS\tCLIENTS\tLAST EVENT\tSTATE\tERRORS\tLAST ERROR")
	now := time.Now()
	for _, s := range srcs {
		synced := "no"
		if s.Synced {
			synced = "yes"
		}
		switch {
		case !s.Blocking:
			synced += " (not blocking)"
		case s.Optional && !s.Synced && !s.FailingSince.IsZero():
			synced += " (optional, failing: not waited for)"
		}
		last := "-"
		if !s.LastUpdate.IsZero() {
			last = roughly(now.Sub(s.LastUpdate)) + " ago"
		}
		state := "ok"
		if !s.FailingSince.IsZero() {
			state = "down for " + roughly(now.Sub(s.FailingSince))
		}
		lastErr := s.LastError
		if len(lastErr) > 160 {
			lastErr = lastErr[:157] + "..."
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%d\t%s\t%s\t%d\t%s\n", s.Name, s.Priority, synced, s.Objects, s.Clients, last, state, s.Errors, lastErr)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, s := range srcs {
		if s.Detail != "" {
			fmt.Fprintf(w, "%s: %s\n", s.Name, s.Detail)
		}
	}
	return nil
}

// roughly rounds d for people: tenths of a second below 10 s, else seconds.
func roughly(d time.Duration) string {
	if d < 10*time.Second {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}

// writeMesh prints the name sources, and the agent's readiness when there
// is no state file to show it (an agent reached with --admin).
func (s *Status) writeMesh(w io.Writer) error {
	if len(s.Sources) == 0 {
		return nil
	}
	fmt.Fprintln(w)
	if s.Agent == nil {
		fmt.Fprintf(w, "agent ready: %s\n\n", s.Ready)
	}
	return writeSources(w, s.Sources)
}

// readSourcesInto adds the agent's name sources to a status.
func (s *Status) readSourcesInto(e Endpoint) {
	srcs, err := ReadSources(e)
	if err != nil {
		s.Errors = append(s.Errors, "name sources: "+err.Error())
		return
	}
	s.Sources = srcs
}

// ReadStatusAt is ReadStatus with the agent reached at admin when given
// (an agent in --mode off writes no state file).
func ReadStatusAt(stateDir, pinDir, admin string) *Status {
	s := ReadStatus(stateDir, pinDir)
	if admin == "" {
		return s
	}
	e := Endpoint{Addr: admin}
	s.Ready = readyAt(e)
	s.Sources = nil
	s.readSourcesInto(e)
	s.readEgressInto(e)
	return s
}

// readEgressInto adds the agent's egress status (none without --egress).
func (s *Status) readEgressInto(e Endpoint) {
	eg, err := ReadEgress(e)
	switch {
	case errors.Is(err, ErrNotServed):
	case err != nil:
		s.Errors = append(s.Errors, "egress: "+err.Error())
	default:
		s.Egress = eg
	}
}

// readyAt asks the agent's /readyz: "yes", or why not.
func readyAt(e Endpoint) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	resp, err := e.get(ctx, "/readyz")
	var notOK *statusError
	switch {
	case errors.As(err, &notOK):
		return "no: " + notOK.body
	case err != nil:
		return "unknown: " + err.Error()
	}
	resp.Body.Close()
	return "yes"
}
