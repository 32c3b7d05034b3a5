// Package captureplan is the capture plan both datapaths share: which
// nameservers are captured and the slot each one is redirected to, and the
// capture-all slots (docs/design.md, "Where a captured query goes"). It is
// computed once, by [New], and read by the eBPF datapath
// (internal/redirect), the iptables one (internal/ctzone) and the agent
// (the ports its resolver listens on, and its check that it never forwards
// to itself): the rules, a duplicate nameserver being an error among them,
// are the same in every mode.
package captureplan

import (
	"errors"
	"fmt"
	"net/netip"
)

// CaptureAllSlots is how many slots capture-all adds after the nameservers'
// (bpf/redirect.c's MAX_ALL_SLOTS; internal/redirect checks they agree).
// Every datapath reserves them, so the resolver listens on the same ports
// in every mode.
const CaptureAllSlots = 4

// ErrNothing is New's error when nothing would be captured.
var ErrNothing = errors.New("nothing to capture: give nameservers or enable capture-all")

// Plan is a validated, read-only capture plan. Nameserver i is captured to
// slot i (port base+i, base being the resolver's listen port); with
// capture-all, other destinations go to the slots after the nameservers'.
type Plan struct {
	nameservers []netip.Addr
	captureAll  bool
}

// New validates the captured nameservers and returns the plan. Addresses are
// unmapped (a v4-mapped v6 address is its v4 address) and lose their zone;
// an invalid or unspecified address is an error, and so is an address
// listed twice: it names the duplicate. Without nameservers, capture-all
// must be on.
func New(nameservers []netip.Addr, captureAll bool) (Plan, error) {
	p := Plan{captureAll: captureAll}
	seen := make(map[netip.Addr]int, len(nameservers))
	for i, ns := range nameservers {
		a := ns.Unmap().WithZone("")
		if !a.IsValid() || a.IsUnspecified() {
			return Plan{}, fmt.Errorf("nameserver %q is not a usable address", ns)
		}
		if j, dup := seen[a]; dup {
			return Plan{}, fmt.Errorf("nameserver %s is listed twice (positions %d and %d): each nameserver takes one slot", a, j+1, i+1)
		}
		seen[a] = i
		p.nameservers = append(p.nameservers, a)
	}
	if len(p.nameservers) == 0 && !captureAll {
		return Plan{}, ErrNothing
	}
	return p, nil
}

// Nameservers returns the captured nameservers in slot order (a copy).
func (p Plan) Nameservers() []netip.Addr { return append([]netip.Addr(nil), p.nameservers...) }

// CaptureAll reports whether every port-53 destination is captured.
func (p Plan) CaptureAll() bool { return p.captureAll }

// AllSlot is the first capture-all slot: the number of nameservers.
func (p Plan) AllSlot() int { return len(p.nameservers) }

// AllSlots is the number of capture-all slots: CaptureAllSlots with
// capture-all, else 0.
func (p Plan) AllSlots() int {
	if p.captureAll {
		return CaptureAllSlots
	}
	return 0
}

// Slots is the number of slots: one per nameserver plus the capture-all ones.
func (p Plan) Slots() int { return len(p.nameservers) + p.AllSlots() }

// Ports returns the slot ports from base: base+i for slot i, stopping at
// 65535 (CheckPorts says whether they all fit).
func (p Plan) Ports(base uint16) []uint16 {
	ports := make([]uint16, 0, p.Slots())
	for i := 0; i < p.Slots() && int(base)+i <= 65535; i++ {
		ports = append(ports, base+uint16(i))
	}
	return ports
}

// CheckPorts reports an error when the slot ports from base run past 65535.
func (p Plan) CheckPorts(base uint16) error {
	if last := int(base) + max(p.Slots(), 1) - 1; last > 65535 {
		return fmt.Errorf("slot ports %d..%d run past 65535", base, last)
	}
	return nil
}

// Owns reports whether dst is one of the resolver's own slot addresses: a
// listen address's IP with a slot port from that address's port (the
// listen port itself counts when there are no slots). An upstream there
// would be the resolver forwarding to itself; another port on the same IP
// is someone else's server.
func (p Plan) Owns(listen []netip.AddrPort, dst netip.AddrPort) bool {
	for _, l := range listen {
		if dst.Addr() == l.Addr() && dst.Port() >= l.Port() && int(dst.Port()) < int(l.Port())+max(p.Slots(), 1) {
			return true
		}
	}
	return false
}
