package egressctl

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
)

// Status is what `meshdns-ebpf status` shows of DNS-gated egress (the
// agent's /debug/egress).
type Status struct {
	Workloads  []WorkloadStatus `json:"workloads"`
	Grants     int              `json:"grants"`      // live grants on the node
	GrantCap   int              `json:"grant_cap"`   // --egress-max-grants
	Quota      int              `json:"quota"`       // grants one workload may hold
	SyncErrors int64            `json:"sync_errors"` // syncs that failed to write the datapath
	EventsLost uint64           `json:"events_lost"`
	Error      string           `json:"error,omitempty"` // the counters could not be read
}

// WorkloadStatus is one selected workload.
type WorkloadStatus struct {
	ID       uint32                `json:"id"`
	Workload string                `json:"workload"`
	Cgroup   string                `json:"cgroup"`
	Policy   string                `json:"policy"`
	Mode     egresspolicy.Mode     `json:"mode"`
	FailMode egresspolicy.FailMode `json:"fail_mode"`
	Internal bool                  `json:"cluster_internal,omitempty"`
	Grants   int                   `json:"grants"`
	Counts   egress.Counts         `json:"counts"`
}

// GrantCounter reads the grant map's bookkeeping: (*egress.Grants) implements it.
type GrantCounter interface {
	Len(wl egress.WorkloadID) (total, workload int)
	Limits() (limit, quota int)
}

// Status gathers the status from the controller, the counters and the grants.
func (c *Controller) Status(count Counter, grants GrantCounter) Status {
	st := Status{SyncErrors: c.Errors(), EventsLost: count.EventsLost()}
	st.GrantCap, st.Quota = grants.Limits()
	st.Grants, _ = grants.Len(0)
	counts, err := count.Counts()
	if err != nil {
		st.Error = err.Error()
	}
	for _, s := range c.Selected() {
		_, n := grants.Len(s.ID)
		st.Workloads = append(st.Workloads, WorkloadStatus{ID: uint32(s.ID), Workload: s.Workload, Cgroup: s.Path,
			Policy: s.Policy.ID(), Mode: s.Policy.Mode, FailMode: s.Policy.FailMode, Internal: s.Policy.ClusterInternal,
			Grants: n, Counts: counts[s.ID]})
	}
	return st
}

// WriteTable prints the status for people: one line per selected workload.
func (s *Status) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "egress: %d workloads selected, %d grants (cap %d, %d per workload)", len(s.Workloads), s.Grants, s.GrantCap, s.Quota)
	if s.SyncErrors > 0 || s.EventsLost > 0 {
		fmt.Fprintf(w, ", %d failed syncs, %d events lost", s.SyncErrors, s.EventsLost)
	}
	fmt.Fprintln(w)
	if s.Error != "" {
		fmt.Fprintln(w, "note: egress counters:", s.Error)
	}
	if len(s.Workloads) == 0 {
		return nil
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "WORKLOAD\tPOLICY\tMODE\tFAIL MODE\tGRANTS\tGRANTED\tINTERNAL\tDENIED\tAUDITED\tFAIL-OPEN")
	for _, ws := range s.Workloads {
		c := ws.Counts
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\n", ws.Workload, ws.Policy, ws.Mode, ws.FailMode, ws.Grants,
			c.AllowedGrant, c.AllowedInternal, c.Denied, c.Audited, c.FailOpen)
	}
	return tw.Flush()
}
