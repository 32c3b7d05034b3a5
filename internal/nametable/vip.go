package nametable

import (
	"cmp"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
)

// Auto-allocated VIP ranges (the ones Istio uses): class E 240.240.0.0/16
// and 2001:2::/48. Slot s (1..65534) maps to 240.240.<s/256>.<s%256> and
// 2001:2::f0f0:<s>, so a host's v4 and v6 VIPs always pair up.
var (
	vipPrefix4 = netip.MustParsePrefix("240.240.0.0/16")
	vipPrefix6 = netip.MustParsePrefix("2001:2::/48")
)

// vipSlots excludes 240.240.0.0 and 240.240.255.255.
const vipSlots = 65534

type vipPair struct{ v4, v6 netip.Addr }

func vipForSlot(s int) vipPair {
	v4 := netip.AddrFrom4([4]byte{240, 240, byte(s >> 8), byte(s)})
	v6 := netip.AddrFrom16([16]byte{0x20, 0x01, 0, 0x02, 12: 0xf0, 13: 0xf0, 14: byte(s >> 8), 15: byte(s)})
	return vipPair{v4, v6}
}

// vipHome is the preferred slot of a host: FNV-1a of the lower-case FQDN.
func vipHome(name string) int {
	h := fnv.New64a()
	_, _ = h.Write([]byte(name))
	return int(h.Sum64()%vipSlots) + 1
}

func vipSlotOf(a netip.Addr) (int, bool) {
	a = a.Unmap()
	if !a.Is4() || !vipPrefix4.Contains(a) {
		return 0, false
	}
	b := a.As4()
	s := int(b[2])<<8 | int(b[3])
	return s, s >= 1 && s <= vipSlots
}

// vipAllocator hands out VIP slots. A host name keeps its slot for as long
// as any host of that name holds it (leases are counted per name), so a VIP
// never moves while its host exists. Slots of explicit addresses inside
// the range are reserved while a host has them.
type vipAllocator struct {
	used     []bool // slot -> leased or reserved
	leased   []bool // slot -> leased
	leases   map[string]*vipLease
	reserved map[int]int // slot -> hosts with that explicit address
	free     int
}

type vipLease struct {
	slot int
	refs int
}

func newVIPAllocator() vipAllocator {
	a := vipAllocator{used: make([]bool, vipSlots+2), leased: make([]bool, vipSlots+2), leases: map[string]*vipLease{}, reserved: map[int]int{}, free: vipSlots}
	a.used[0], a.used[vipSlots+1] = true, true
	return a
}

// lease returns the VIP of name when it has one already, taking a
// reference.
func (a *vipAllocator) lease(name string) (vipPair, bool) {
	l := a.leases[name]
	if l == nil {
		return vipPair{}, false
	}
	l.refs++
	return vipForSlot(l.slot), true
}

// allocate gives each host (which must not have a lease) a slot, in the
// order of (Order, Name): its hash home, or the next free slot after it
// (linear probing, wrapping). Hosts of one name share a slot.
func (a *vipAllocator) allocate(hosts []*Host) error {
	slices.SortStableFunc(hosts, func(x, y *Host) int {
		return cmp.Or(cmp.Compare(x.Order(), y.Order()), cmp.Compare(x.Name, y.Name))
	})
	for _, h := range hosts {
		if p, ok := a.lease(h.Name); ok {
			h.V4, h.V6 = []netip.Addr{p.v4}, []netip.Addr{p.v6}
			h.AutoVIP = true
			continue
		}
		if a.free == 0 {
			return fmt.Errorf("host %s needs an auto-allocated VIP but all %d slots of %s are taken", h.Name, vipSlots, vipPrefix4)
		}
		s := vipHome(h.Name)
		for a.used[s] {
			if s++; s > vipSlots {
				s = 1
			}
		}
		a.used[s], a.leased[s] = true, true
		a.free--
		a.leases[h.Name] = &vipLease{slot: s, refs: 1}
		p := vipForSlot(s)
		h.V4, h.V6 = []netip.Addr{p.v4}, []netip.Addr{p.v6}
		h.AutoVIP = true
	}
	return nil
}

// release drops a reference; the slot is freed by sweep, so a host that is
// removed and added back in one batch keeps its VIP.
func (a *vipAllocator) release(name string) {
	if l := a.leases[name]; l != nil {
		l.refs--
	}
}

// sweep frees the slots of names nobody holds any more.
func (a *vipAllocator) sweep() {
	for name, l := range a.leases {
		if l.refs <= 0 {
			delete(a.leases, name)
			a.leased[l.slot] = false
			if a.reserved[l.slot] == 0 {
				a.used[l.slot] = false
				a.free++
			}
		}
	}
}

// reserve marks the slots of explicit addresses in the range as used.
func (a *vipAllocator) reserve(h *Host, delta int) {
	for _, ip := range h.V4 {
		s, ok := vipSlotOf(ip)
		if !ok {
			continue
		}
		n := a.reserved[s] + delta
		switch {
		case n <= 0:
			delete(a.reserved, s)
			if !a.leased[s] && a.used[s] {
				a.used[s] = false
				a.free++
			}
		default:
			a.reserved[s] = n
			if !a.used[s] {
				a.used[s] = true
				a.free--
			}
		}
	}
}
