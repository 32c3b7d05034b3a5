//go:build linux

package ctzone

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/ti-mo/conntrack"
)

const (
	protoTCP = 6
	protoUDP = 17
)

func dialConntrack() (*conntrack.Conn, error) {
	if guard != nil {
		if err := guard(); err != nil {
			return nil, err
		}
	}
	c, err := conntrack.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("open conntrack netlink socket: %w", err)
	}
	return c, nil
}

// slotTarget is an address:port range the resolver listens on (a DNAT target).
type slotTarget struct {
	addr   netip.Addr
	lo, hi uint16
}

func (t slotTarget) has(ap netip.AddrPort) bool {
	return ap.Addr().Unmap() == t.addr && ap.Port() >= t.lo && ap.Port() <= t.hi
}

func slotTargets(f family) []slotTarget {
	return []slotTarget{{addr: f.listen.Addr(), lo: f.minPort, hi: f.maxPort}}
}

// ruleZones returns the zone a saved rule sets ("-j CT --zone N").
func ruleZones(rule string) []uint16 {
	f := strings.Fields(rule)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "--zone" {
			if z, err := strconv.ParseUint(f[i+1], 0, 16); err == nil && z != 0 {
				return []uint16{uint16(z)}
			}
		}
	}
	return nil
}

// ruleTargets returns the DNAT target of a saved rule ("--to-destination a:p").
func ruleTargets(rule string) []slotTarget {
	f := strings.Fields(rule)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "--to-destination" {
			if ap, err := netip.ParseAddrPort(f[i+1]); err == nil {
				return []slotTarget{{addr: ap.Addr(), lo: ap.Port(), hi: ap.Port()}}
			}
		}
	}
	return nil
}

func origDst(f conntrack.Flow) netip.AddrPort {
	return netip.AddrPortFrom(f.TupleOrig.IP.DestinationAddress.Unmap(), f.TupleOrig.Proto.DestinationPort)
}

// replySrc is where replies come from: for a DNATed flow, the NAT target.
func replySrc(f conntrack.Flow) netip.AddrPort {
	return netip.AddrPortFrom(f.TupleReply.IP.SourceAddress.Unmap(), f.TupleReply.Proto.SourcePort)
}

// deleteFlows deletes the flows for which drop is true; entries that vanished
// meanwhile are not an error.
func deleteFlows(drop func(conntrack.Flow) bool) (int, error) {
	c, err := dialConntrack()
	if err != nil {
		return 0, err
	}
	defer c.Close()
	flows, err := c.Dump(nil)
	if err != nil {
		return 0, fmt.Errorf("dump conntrack table: %w", err)
	}
	n := 0
	var errs []error
	for _, f := range flows {
		if !drop(f) {
			continue
		}
		err := c.Delete(conntrack.Flow{TupleOrig: f.TupleOrig, TupleReply: f.TupleReply, Zone: f.Zone})
		switch {
		case err == nil:
			n++
		case errors.Is(err, syscall.ENOENT):
		default:
			errs = append(errs, fmt.Errorf("delete conntrack entry %v zone %d: %w", f.TupleOrig, f.Zone, err))
		}
	}
	return n, errors.Join(errs...)
}

// expectedTarget is where a captured UDP query to dst must be NATed to under the
// current rules (ok false: dst is not captured).
func (r *Rules) expectedTarget(dst netip.AddrPort) (netip.AddrPort, bool) {
	if dst.Port() != 53 {
		return netip.AddrPort{}, false
	}
	a := dst.Addr().Unmap()
	f := r.cfg.fams[0]
	if a.Is6() {
		f = r.cfg.fams[1]
	}
	if !f.captures() {
		return netip.AddrPort{}, false
	}
	for _, s := range f.servers {
		if s.addr == a {
			return netip.AddrPortFrom(f.listen.Addr(), s.port), true
		}
	}
	if f.all && !a.IsLoopback() && a != f.listen.Addr() {
		return netip.AddrPortFrom(f.listen.Addr(), f.allPort), true
	}
	return netip.AddrPort{}, false
}

// flushStale deletes the UDP conntrack entries that would send a query the wrong
// way under the rules just installed (runs inside the namespace):
//   - in our zone, a port-53 entry that is not NATed to the slot its destination
//     maps to now (made while the nat rules were missing or with another
//     configuration): the next query of that 4-tuple would skip the resolver;
//   - in any other zone, an entry NATed to the resolver (made while the zone
//     rules were missing): the resolver's or a proxy's upstream query of that
//     4-tuple would be sent back to the resolver.
func (r *Rules) flushStale() (int, error) {
	var targets []slotTarget
	for _, f := range r.cfg.fams {
		if f.captures() {
			targets = append(targets, slotTargets(f)...)
		}
	}
	return deleteFlows(func(f conntrack.Flow) bool {
		if f.TupleOrig.Proto.Protocol != protoUDP {
			return false
		}
		if f.Zone == r.cfg.Zone {
			dst := origDst(f)
			if dst.Port() != 53 {
				return false // a query addressed to the resolver itself
			}
			want, ok := r.expectedTarget(dst)
			return !ok || !f.Status.DstNAT() || replySrc(f) != want
		}
		return natedToTarget(f, targets)
	})
}

// flushZones deletes every entry of the zones and every UDP entry of another
// zone NATed to one of the targets (runs inside the namespace).
func flushZones(zones []uint16, targets []slotTarget) (int, error) {
	return deleteFlows(func(f conntrack.Flow) bool {
		if f.Zone != 0 && slices.Contains(zones, f.Zone) {
			return true
		}
		return f.TupleOrig.Proto.Protocol == protoUDP && natedToTarget(f, targets)
	})
}

// natedToTarget reports whether f is DNATed to one of the resolver's slots.
func natedToTarget(f conntrack.Flow, targets []slotTarget) bool {
	if !f.Status.DstNAT() {
		return false
	}
	src := replySrc(f)
	for _, t := range targets {
		if t.has(src) {
			return true
		}
	}
	return false
}

// ReadConntrackStatus reads the port-53 entries per zone and the kernel's
// conntrack statistics of the calling thread's network namespace.
func ReadConntrackStatus() (*ConntrackStatus, error) {
	c, err := dialConntrack()
	if err != nil {
		return nil, err
	}
	defer c.Close()
	flows, err := c.Dump(nil)
	if err != nil {
		return nil, fmt.Errorf("dump conntrack table: %w", err)
	}
	type k struct {
		zone  uint16
		proto string
	}
	counts := map[k]*ZoneEntries{}
	for _, f := range flows {
		var proto string
		switch f.TupleOrig.Proto.Protocol {
		case protoUDP:
			proto = "udp"
		case protoTCP:
			proto = "tcp"
		default:
			continue
		}
		if f.TupleOrig.Proto.DestinationPort != 53 {
			continue
		}
		z := counts[k{f.Zone, proto}]
		if z == nil {
			z = &ZoneEntries{Zone: f.Zone, Proto: proto}
			counts[k{f.Zone, proto}] = z
		}
		z.Entries++
		if f.Status.DstNAT() {
			z.NATed++
		}
		if !f.Status.SeenReply() {
			z.Unreplied++
		}
	}
	s := &ConntrackStatus{Total: CPUStat{CPU: -1}}
	for _, z := range counts {
		s.Zones = append(s.Zones, *z)
	}
	slices.SortFunc(s.Zones, func(a, b ZoneEntries) int {
		if a.Zone != b.Zone {
			return int(a.Zone) - int(b.Zone)
		}
		return strings.Compare(a.Proto, b.Proto)
	})
	stats, err := c.Stats()
	if err != nil {
		return nil, fmt.Errorf("read conntrack statistics: %w", err)
	}
	for _, st := range stats {
		cs := CPUStat{CPU: int(st.CPUID), Found: uint64(st.Found), Invalid: uint64(st.Invalid), Ignore: uint64(st.Ignore),
			Insert: uint64(st.Insert), InsertFailed: uint64(st.InsertFailed), Drop: uint64(st.Drop),
			EarlyDrop: uint64(st.EarlyDrop), Error: uint64(st.Error), SearchRestart: uint64(st.SearchRestart)}
		s.Stats = append(s.Stats, cs)
		s.Total.add(cs)
	}
	g, err := c.StatsGlobal()
	if err != nil {
		return nil, fmt.Errorf("read conntrack table size: %w", err)
	}
	s.Entries, s.MaxEntries = int(g.Entries), int(g.MaxEntries)
	return s, nil
}
