package redirect

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
)

// The egress maps of bpf/redirect.c ("DNS-gated egress"), their layouts
// exported for internal/egress, which owns what goes into them. The types are
// bpf2go's: the C source is their only definition.
type (
	// EgressRule is an egress_workloads value: a selected cgroup's workload id and flags.
	EgressRule = redirectEgressRule
	// EgressGrantKey is an egress_grants key: (workload, address), IPv4 as ::ffff:a.b.c.d.
	EgressGrantKey = redirectEgressGrantKey
	// EgressGrant is an egress_grants value: expiry (CLOCK_MONOTONIC ns) and ports.
	EgressGrant = redirectEgressGrant
	// EgressPort is one (port, protocol) of a grant; 0 is any.
	EgressPort = redirectEgressPort
	// EgressLPMKey is an egress_internal key.
	EgressLPMKey = redirectEgressLpmKey
	// EgressCounters is one CPU's egress_stats value.
	EgressCounters = redirectEgressCounters
	// EgressEvent is one record of the egress_events ring buffer.
	EgressEvent = redirectEgressEvent
)

// Egress rule flags, counters, verdicts and limits (bpf/redirect.c's enums).
const (
	EgressEnforce         = uint32(redirectEgressRuleFlagsEGRESS_ENFORCE)
	EgressFailClosed      = uint32(redirectEgressRuleFlagsEGRESS_FAIL_CLOSED)
	EgressInternalInScope = uint32(redirectEgressRuleFlagsEGRESS_INTERNAL_IN_SCOPE)

	EgressAllowedGrant    = int(redirectEgressCounterEGRESS_ALLOWED_GRANT)
	EgressAllowedInternal = int(redirectEgressCounterEGRESS_ALLOWED_INTERNAL)
	EgressDenied          = int(redirectEgressCounterEGRESS_DENIED)
	EgressAudited         = int(redirectEgressCounterEGRESS_AUDITED)
	EgressFailOpen        = int(redirectEgressCounterEGRESS_FAIL_OPEN)
	EgressEventDropped    = int(redirectEgressCounterEGRESS_EVENT_DROPPED)
	NumEgressCounters     = int(redirectEgressCounterNUM_EGRESS_COUNTERS)

	VerdictDenied  = uint8(redirectEgressVerdictVERDICT_DENIED)
	VerdictAudited = uint8(redirectEgressVerdictVERDICT_AUDITED)

	// EgressPorts is how many (port, protocol) pairs one grant holds.
	EgressPorts = int(redirectMeshdnsLimitsEGRESS_PORTS)
	// EgressMaxWorkloads is how many cgroups can be selected at once.
	EgressMaxWorkloads = int(redirectMeshdnsLimitsEGRESS_MAX_WORKLOADS)
	// EgressMaxInternal is how many internal prefixes the programs hold.
	EgressMaxInternal = int(redirectMeshdnsLimitsEGRESS_INTERNAL)
	// DefaultEgressGrants is the grant cap when Config.EgressGrants is 0.
	DefaultEgressGrants = int(redirectMeshdnsLimitsEGRESS_GRANTS)
	// EgressLevels is how many cgroup levels below the root the programs walk
	// to find a task's workload: a selected cgroup deeper than that is not found.
	EgressLevels = int(redirectMeshdnsLimitsEGRESS_LEVELS)
)

const flagEgress = uint32(redirectMeshdnsFlagsFLAG_EGRESS)

// EgressMaps are the datapath's egress maps (pinned with the others, so they
// survive a restart and pass to a successor) and its switch.
type EgressMaps struct {
	Workloads *ebpf.Map // cgroup id (uint64) -> EgressRule
	Grants    *ebpf.Map // EgressGrantKey -> EgressGrant; MaxEntries is the grant cap
	Internal  *ebpf.Map // EgressLPMKey -> uint32 (unused)
	Stats     *ebpf.Map // workload id (uint32) -> per-CPU EgressCounters
	Events    *ebpf.Map // ring buffer of EgressEvent

	d *Datapath
}

// Egress returns the datapath's egress maps (nil before Start). They are
// closed by Close.
func (d *Datapath) Egress() *EgressMaps {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.started || d.closed || d.objs.EgressGrants == nil {
		return nil
	}
	o := &d.objs
	return &EgressMaps{Workloads: o.EgressWorkloads, Grants: o.EgressGrants, Internal: o.EgressInternal,
		Stats: o.EgressStats, Events: o.EgressEvents, d: d}
}

// SetEnabled switches egress enforcement on or off (FLAG_EGRESS in the config
// map). Off, the programs test one flag and pass. The flag is kept across a
// restart: a new datapath on the same pins keeps what the last agent set until
// it is told otherwise, so a fail-closed workload is never left open between
// two agents.
func (m *EgressMaps) SetEnabled(on bool) error {
	d := m.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("egress: datapath closed")
	}
	if on {
		d.set.flags |= flagEgress
	} else {
		d.set.flags &^= flagEgress
	}
	var c redirectMeshdnsConfig
	if err := d.objs.Config.Lookup(uint32(0), &c); err != nil {
		return fmt.Errorf("read config map: %w", err)
	}
	c.Flags = c.Flags&^flagEgress | d.set.flags&flagEgress
	if err := d.objs.Config.Put(uint32(0), &c); err != nil {
		return fmt.Errorf("write config map: %w", err)
	}
	return nil
}

// Enabled reports whether egress enforcement is on.
func (m *EgressMaps) Enabled() bool {
	m.d.mu.Lock()
	defer m.d.mu.Unlock()
	return m.d.set.flags&flagEgress != 0
}

// keptEgressFlag returns FLAG_EGRESS as a reused config map holds it (what the
// previous agent left), or 0.
func keptEgressFlag(m *ebpf.Map) uint32 {
	var c redirectMeshdnsConfig
	if err := m.Lookup(uint32(0), &c); err != nil {
		return 0
	}
	return c.Flags & flagEgress
}
