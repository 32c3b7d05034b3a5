package nametable

import (
	"fmt"
	"hash/fnv"
	"net/netip"
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

// allocateVIPs gives every host (sorted, lower-case FQDNs) a slot: its hash
// home, or the next free slot after it (linear probing, wrapping). Slots of
// addresses the file assigns explicitly inside 240.240.0.0/16 are taken
// first. The result depends only on the set of names and reserved
// addresses, never on time or on a previous run.
func allocateVIPs(sorted []string, reserved []netip.Addr) ([]vipPair, error) {
	if len(sorted) == 0 {
		return nil, nil
	}
	used := make([]bool, vipSlots+2)
	used[0], used[vipSlots+1] = true, true
	free := vipSlots
	for _, a := range reserved {
		b := a.As4()
		if s := int(b[2])<<8 | int(b[3]); !used[s] {
			used[s] = true
			free--
		}
	}
	if len(sorted) > free {
		return nil, fmt.Errorf("%d external hosts need an auto-allocated VIP but only %d of %d slots in %s are free",
			len(sorted), free, vipSlots, vipPrefix4)
	}
	out := make([]vipPair, len(sorted))
	for i, name := range sorted {
		s := vipHome(name)
		for used[s] {
			s++
			if s > vipSlots {
				s = 1
			}
		}
		used[s] = true
		out[i] = vipForSlot(s)
	}
	return out, nil
}
