package agent

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// Status is what `meshdns-ebpf status` shows: the agent's own account (state file),
// whether it is alive and ready, what the kernel has attached, and conntrack.
type Status struct {
	Agent     *State                  `json:"agent,omitempty"`
	Running   bool                    `json:"running"`
	Ready     string                  `json:"ready"` // "yes", or why not
	Datapath  *redirect.Status        `json:"datapath,omitempty"`
	Conntrack *ctzone.ConntrackStatus `json:"conntrack,omitempty"`
	Errors    []string                `json:"errors,omitempty"`
	// Sources are the agent's name sources and their sync state.
	Sources []names.SourceStatus `json:"sources,omitempty"`
}

// PinDir is where the CLI looks for the agent's pins: flag (--bpffs) when
// given, else the directory the agent's state file in stateDir records, else
// DefaultBPFFS.
func PinDir(stateDir, flag string) string {
	if flag != "" {
		return flag
	}
	if st, err := ReadState(stateDir); err == nil && st.BPFFS != "" {
		return st.BPFFS
	}
	return DefaultBPFFS
}

// ReadStatus gathers the status; what cannot be read is reported in Errors.
// pinDir "" means PinDir's choice.
func ReadStatus(stateDir, pinDir string) *Status {
	s := &Status{Ready: "no agent state"}
	st, err := ReadState(stateDir)
	running, lerr := Locked(stateDir)
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
	if ds, err := redirect.ReadStatus(PinDir(stateDir, pinDir)); err == nil {
		s.Datapath = ds
	} else if s.Agent == nil || s.Agent.Mode == ModeEBPF {
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
		}
	}
	return s
}

func probeReady(stateDir string, st *State, running bool) string {
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
	for _, e := range s.Errors {
		fmt.Fprintln(w, "note:", e)
	}
	return nil
}

// Cleanup removes what a crashed or stopped agent left: pinned links and maps
// (which detaches the programs), iptables chains and rules, the node address it
// added, and its state file. It holds the state lock while it works, and refuses
// while an agent holds it. It is safe to run on a clean node.
func Cleanup(stateDir, pinDir string, log *slog.Logger) ([]string, error) {
	var removed []string
	var errs []error
	lock, err := tryLock(stateDir)
	if errors.Is(err, errLocked) {
		pid := "?"
		if st, err := ReadState(stateDir); err == nil {
			pid = fmt.Sprint(st.PID)
		}
		return nil, fmt.Errorf("an agent (pid %s per its state file) holds the lock of %s: stop it first", pid, stateDir)
	}
	if err != nil {
		return nil, err
	}
	defer lock.release()
	st, _ := ReadState(stateDir)
	r, err := redirect.Cleanup(PinDir(stateDir, pinDir))
	removed = append(removed, r...)
	if err != nil {
		errs = append(errs, err)
	}
	backend := ""
	if st != nil {
		backend = st.Backend
	}
	r, err = ctzone.Cleanup(backend)
	removed = append(removed, r...)
	if err != nil {
		errs = append(errs, err)
	}
	if st != nil && len(st.NodeAddrs) > 0 && st.Netns != 0 && st.Netns != currentNetns() {
		errs = append(errs, fmt.Errorf("the agent ran in another network namespace (inode %d); run cleanup there to remove its addresses %v", st.Netns, st.NodeAddrs))
		return removed, errors.Join(errs...)
	}
	if st != nil {
		if err := removeNodeAddrs(st.NodeAddrs, log); err != nil {
			errs = append(errs, err)
		} else {
			for _, na := range st.NodeAddrs {
				if na.CreatedLink {
					removed = append(removed, "link "+na.Link)
				} else {
					removed = append(removed, "address "+na.Addr+" on "+na.Link)
				}
			}
		}
		if err := removeState(stateDir); err != nil {
			errs = append(errs, err)
		} else {
			removed = append(removed, "state file "+statePath(stateDir))
		}
	}
	for what, p := range map[string]string{"handover socket": handoverPath(stateDir), "local admin socket": LocalPath(stateDir)} {
		if err := os.Remove(p); err == nil {
			removed = append(removed, what+" "+p)
		}
	}
	return removed, errors.Join(errs...)
}
