package redirect

import (
	"fmt"
	"io"
	"os"
	"slices"
	"text/tabwriter"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// CgroupProgram is one program the kernel runs for sockets of the capture cgroup
// on one of the datapath's hooks: ours, or another datapath's (Cilium's socket
// load balancer, Calico's eBPF dataplane). Programs of one hook run in Position
// order, each seeing the address the previous ones left: one that runs before
// ours can rewrite the cluster DNS address before ours compares it with the
// captured nameservers.
type CgroupProgram struct {
	Hook      string `json:"hook"`
	Position  int    `json:"position"` // 1 runs first
	ProgramID uint32 `json:"program_id"`
	LinkID    uint32 `json:"link_id,omitempty"`
	// Name is the program's name, when this process may read it (reading
	// another's program by ID needs CAP_SYS_ADMIN, which the agent lacks).
	Name string `json:"name,omitempty"`
	Ours bool   `json:"ours"`
	// Inherited programs are attached to an ancestor cgroup: they run after
	// the capture cgroup's own.
	Inherited bool `json:"inherited"`
}

// QueryCgroupPrograms lists, for each hook of the datapath, the programs that
// run for sockets of the cgroup at path, in the order they run (BPF_PROG_QUERY
// with BPF_F_QUERY_EFFECTIVE), marking those whose ID is in ours.
func QueryCgroupPrograms(path string, ours map[uint32]bool) ([]CgroupProgram, error) {
	dir, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open capture cgroup: %w", err)
	}
	defer dir.Close()
	fd := int(dir.Fd())
	var out []CgroupProgram
	for _, h := range hooks {
		eff, err := link.QueryPrograms(link.QueryOptions{Target: fd, Attach: h.attach, QueryFlags: bpfQueryEffective})
		if err != nil {
			return nil, fmt.Errorf("query %s programs of %s: %w", h.name, path, err)
		}
		own, err := link.QueryPrograms(link.QueryOptions{Target: fd, Attach: h.attach})
		if err != nil {
			return nil, fmt.Errorf("query %s programs of %s: %w", h.name, path, err)
		}
		here := map[ebpf.ProgramID]uint32{} // attached to the cgroup itself -> link ID
		for _, p := range own.Programs {
			lid, _ := p.LinkID()
			here[p.ID] = uint32(lid)
		}
		for i, p := range eff.Programs {
			lid, attachedHere := here[p.ID]
			out = append(out, CgroupProgram{
				Hook: h.name, Position: i + 1, ProgramID: uint32(p.ID), LinkID: lid,
				Name: programName(p.ID), Ours: ours[uint32(p.ID)], Inherited: !attachedHere,
			})
		}
	}
	return out, nil
}

// programName reads a program's name by ID, "" when not permitted.
func programName(id ebpf.ProgramID) string {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return ""
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return ""
	}
	return info.Name
}

// Foreign counts the other programs of one hook that run before and after ours.
type Foreign struct{ Before, After int }

// ForeignPrograms counts, per hook, the programs that are not ours, before and
// after the first of ours (all before, when ours is missing).
func ForeignPrograms(progs []CgroupProgram) map[string]Foreign {
	out := map[string]Foreign{}
	seen := map[string]bool{}
	for _, h := range hooks {
		out[h.name] = Foreign{}
	}
	for _, p := range progs {
		f := out[p.Hook]
		switch {
		case p.Ours:
			seen[p.Hook] = true
		case seen[p.Hook]:
			f.After++
		default:
			f.Before++
		}
		out[p.Hook] = f
	}
	return out
}

// CgroupPrograms lists the programs that run for sockets of the capture cgroup on
// the datapath's hooks (see QueryCgroupPrograms).
func (d *Datapath) CgroupPrograms() ([]CgroupProgram, error) {
	return QueryCgroupPrograms(d.set.cfg.Cgroup, ourIDs(d.Programs()))
}

// ourIDs are the program IDs of progs.
func ourIDs(progs []ProgramInfo) map[uint32]bool {
	ours := map[uint32]bool{}
	for _, p := range progs {
		ours[p.ProgramID] = true
	}
	return ours
}

// logCoexistence logs the other programs on the capture cgroup's hooks at start
// (ours: our program IDs):
// one that runs before ours on a hook that rewrites destinations can take the
// query elsewhere first (docs/kubernetes.md, Coexistence).
func (d *Datapath) logCoexistence(ours map[uint32]bool) {
	progs, err := QueryCgroupPrograms(d.set.cfg.Cgroup, ours)
	if err != nil {
		d.log.Warn("could not list the other BPF programs of the capture cgroup", "err", err)
		return
	}
	for hook, f := range ForeignPrograms(progs) {
		if f.Before == 0 && f.After == 0 {
			continue
		}
		var others []string
		for _, p := range progs {
			if p.Hook == hook && !p.Ours {
				others = append(others, fmt.Sprintf("#%d id %d %s", p.Position, p.ProgramID, p.Name))
			}
		}
		if f.Before > 0 {
			d.log.Warn("other BPF programs run before ours on the capture cgroup: they see, and may rewrite, the destination first",
				"hook", hook, "before", f.Before, "after", f.After, "programs", others)
		} else {
			d.log.Info("other BPF programs run after ours on the capture cgroup", "hook", hook, "after", f.After, "programs", others)
		}
	}
}

// writeCgroupPrograms prints the programs of the hooks where others run beside ours.
func writeCgroupPrograms(w io.Writer, progs []CgroupProgram, queryErr string) error {
	if queryErr != "" {
		_, err := fmt.Fprintf(w, "\nother programs on the capture cgroup: unknown (%s)\n", queryErr)
		return err
	}
	foreign := ForeignPrograms(progs)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := false
	for _, p := range progs {
		if f := foreign[p.Hook]; f.Before == 0 && f.After == 0 {
			continue
		}
		if !header {
			fmt.Fprintln(tw, "\nHOOK\tORDER\tPROGRAM ID\tNAME\tOWNER\tATTACHED")
			header = true
		}
		owner, where, name := "other", "capture cgroup", p.Name
		if p.Ours {
			owner = "meshdns-ebpf"
		}
		if p.Inherited {
			where = "an ancestor"
		}
		if name == "" {
			name = "-"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\n", p.Hook, p.Position, p.ProgramID, name, owner, where)
	}
	if !header {
		fmt.Fprintln(tw, "\nother programs on the capture cgroup: none")
	}
	return tw.Flush()
}

// How a query to a captured nameserver is captured on a forward hook, beside
// other datapaths' programs (HookCapture.Mechanism).
const (
	// MechanismOrdering: ours run first on the hook (put in front where the
	// kernel orders cgroup programs, or attached before every other).
	MechanismOrdering = "ordering"
	// MechanismBackendCapture: another program runs first and may translate
	// the nameserver to a backend; ours capture the backends they know.
	MechanismBackendCapture = "backend-capture"
	// MechanismNone: another program runs first and ours know no backend (or
	// ours are not on the hook): its translations are not captured.
	MechanismNone = "none"
)

// Mechanisms are the values of HookCapture.Mechanism.
var Mechanisms = []string{MechanismOrdering, MechanismBackendCapture, MechanismNone}

// HookCapture says, for one forward hook (connect4/6, sendmsg4/6: where a
// query's destination is decided), whether ours run first and by which
// mechanism a query to a captured nameserver is captured there. The reverse
// hooks (recvmsg, getpeername) restore the address the client asked in any
// order: the original they restore is the nameserver's, never a backend's.
type HookCapture struct {
	Hook      string `json:"hook"`
	First     bool   `json:"first"`
	Mechanism string `json:"mechanism"`
}

// forwardHooks are the hooks where a destination is decided.
var forwardHooks = []string{"connect4", "connect6", "sendmsg4", "sendmsg6"}

// HookCaptures says how each forward hook captures, from the programs that run
// on it (QueryCgroupPrograms) and the number of backends ours capture.
func HookCaptures(progs []CgroupProgram, backends int) []HookCapture {
	out := make([]HookCapture, 0, len(forwardHooks))
	for _, h := range forwardHooks {
		hc := HookCapture{Hook: h, Mechanism: MechanismNone}
		for _, p := range progs {
			if p.Hook == h {
				hc.First = p.Ours
				break
			}
		}
		ours := slices.ContainsFunc(progs, func(p CgroupProgram) bool { return p.Hook == h && p.Ours })
		switch {
		case hc.First:
			hc.Mechanism = MechanismOrdering
		case ours && backends > 0:
			hc.Mechanism = MechanismBackendCapture
		}
		out = append(out, hc)
	}
	return out
}

// HookCaptures says how each forward hook of the running datapath captures.
func (d *Datapath) HookCaptures() ([]HookCapture, error) {
	progs, err := d.CgroupPrograms()
	if err != nil {
		return nil, err
	}
	// The map, not the last SetBackends: a successor keeps its
	// predecessor's backends until its own watch has them.
	n := 0
	d.mu.Lock()
	if d.objs.Backends != nil {
		var (
			k redirectNsKey
			v redirectBackend
		)
		it := d.objs.Backends.Iterate()
		for it.Next(&k, &v) {
			n++
		}
	}
	d.mu.Unlock()
	return HookCaptures(progs, n), nil
}

// writeHookCaptures prints, per forward hook, whether ours run first and how
// queries are captured.
func writeHookCaptures(w io.Writer, hcs []HookCapture, backends int) error {
	if len(hcs) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "\nHOOK\tOURS FIRST\tCAPTURE\n")
	for _, hc := range hcs {
		first := "no"
		if hc.First {
			first = "yes"
		}
		what := hc.Mechanism
		switch hc.Mechanism {
		case MechanismBackendCapture:
			what = fmt.Sprintf("%s (%d backends of the captured nameservers)", hc.Mechanism, backends)
		case MechanismNone:
			what = hc.Mechanism + ": another program may translate the nameserver first, and no backend is known"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", hc.Hook, first, what)
	}
	fmt.Fprintln(tw, "recvmsg, getpeername\tany order\trestore the nameserver asked")
	return tw.Flush()
}
