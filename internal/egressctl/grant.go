package egressctl

import (
	"net/netip"
	"sync"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
)

// maxPorts is how many ports a grant converts without allocating.
const maxPorts = 8

// Grant is the resolver's step before it releases an answer to a workload of
// egress workload id wl (0: none, the common case, returns at once): when the
// workload's policy allows the queried name, the answer's final addresses are
// granted on the name's ports for ttl (plus the datapath's grace). An answer
// for a name the policy does not allow grants nothing; its addresses are
// remembered, so a denied connect to them is shown with the name. It returns
// whether a grant was written.
func (c *Controller) Grant(wl uint32, name string, addrs []netip.Addr, ttl time.Duration) (bool, error) {
	if wl == 0 || len(addrs) == 0 {
		return false, nil
	}
	sel := (*c.byID.Load())[egress.WorkloadID(wl)]
	if sel == nil {
		return false, nil // selected by no policy any more
	}
	allowed, ok := sel.Policy.Allows(name)
	if !ok {
		c.notAllowed.Add(1)
		c.unallowed.note(egress.WorkloadID(wl), name, addrs)
		return false, nil
	}
	var buf [maxPorts]egress.Port
	ports := convertPorts(buf[:0], allowed)
	if err := c.cfg.Grants.Grant(egress.WorkloadID(wl), name, addrs, ports, ttl); err != nil {
		c.grantErrs.Add(1)
		return false, err
	}
	c.granted.Add(1)
	return true, nil
}

// convertPorts turns a policy's ports into the datapath's (none: any port).
func convertPorts(dst []egress.Port, ps []egresspolicy.Port) []egress.Port {
	for _, p := range ps {
		proto := egress.ProtoAny
		switch p.Protocol {
		case egresspolicy.TCP:
			proto = egress.ProtoTCP
		case egresspolicy.UDP:
			proto = egress.ProtoUDP
		}
		dst = append(dst, egress.Port{Port: uint16(p.Port), Proto: proto})
	}
	return dst
}

// NameOf is the name a workload was answered for addr but may not use, or "".
func (c *Controller) NameOf(wl egress.WorkloadID, addr netip.Addr) string {
	return c.unallowed.name(wl, addr)
}

// maxUnallowed bounds the remembered unallowed answers; past it the oldest
// half is forgotten.
const maxUnallowed = 4096

type unallowedKey struct {
	wl   egress.WorkloadID
	addr netip.Addr
}

// unallowedNames is a small bounded memory of names answered but not allowed.
type unallowedNames struct {
	mu    sync.Mutex
	m     map[unallowedKey]string
	order []unallowedKey
}

func (u *unallowedNames) init() { u.m = map[unallowedKey]string{} }

func (u *unallowedNames) note(wl egress.WorkloadID, name string, addrs []netip.Addr) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, a := range addrs {
		k := unallowedKey{wl, a.Unmap()}
		if _, ok := u.m[k]; !ok {
			u.order = append(u.order, k)
		}
		u.m[k] = name
	}
	if len(u.order) > maxUnallowed {
		drop := len(u.order) / 2
		for _, k := range u.order[:drop] {
			delete(u.m, k)
		}
		u.order = append(u.order[:0], u.order[drop:]...)
	}
}

func (u *unallowedNames) name(wl egress.WorkloadID, addr netip.Addr) string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.m[unallowedKey{wl, addr.Unmap()}]
}

func (u *unallowedNames) forget(wl egress.WorkloadID) {
	u.mu.Lock()
	defer u.mu.Unlock()
	kept := u.order[:0]
	for _, k := range u.order {
		if k.wl == wl {
			delete(u.m, k)
			continue
		}
		kept = append(kept, k)
	}
	u.order = kept
}
