// Package nodeaddr puts the resolver's node-local listen addresses in place
// over netlink (on a dummy link it creates, or on lo where the kernel has no
// dummy link type), adopts the ones a previous agent recorded, and removes
// exactly what it added or adopted, unless a successor took them over.
package nodeaddr

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
)

// DefaultLinkName is the dummy link that carries the node-local resolver address.
const DefaultLinkName = "meshdns0"

// owned is a node address record of this agent's: one it added, or one it
// adopted from a predecessor (abandoning a takeover leaves those to it).
type owned struct {
	agentstate.NodeAddr
	adopted bool // taken over from a predecessor, not added by this agent
}

// records are the state file's records of what owns holds.
func records(owns []owned) []agentstate.NodeAddr {
	out := make([]agentstate.NodeAddr, 0, len(owns))
	for _, o := range owns {
		out = append(out, o.NodeAddr)
	}
	return out
}

// adoptedRecords returns the records of recs that cover address a: its address
// record and the record of the link it is on, if the agent created that link.
func adoptedRecords(recs []agentstate.NodeAddr, a netip.Addr) []owned {
	var out []owned
	for _, r := range recs {
		if r.Addr == "" {
			continue
		}
		if p, err := netip.ParsePrefix(r.Addr); err == nil && p.Addr() == a {
			for _, l := range recs {
				if l.CreatedLink && l.Link == r.Link {
					out = append(out, owned{l, true})
				}
			}
			out = append(out, owned{r, true})
		}
	}
	return out
}

// Set is the agent's part that puts the node-local listen addresses in
// place and removes what it added on Close.
type Set struct {
	want    []netip.Addr
	link    string
	log     *slog.Logger
	adopt   []agentstate.NodeAddr // a predecessor's records: ours if still present and wanted
	added   []owned               // what we own (adopted or added)
	handoff bool
}

// New is the set of addresses want on link (created when missing), adopting
// the records adopt of a predecessor in this network namespace. It touches
// nothing.
func New(want []netip.Addr, link string, adopt []agentstate.NodeAddr, log *slog.Logger) *Set {
	return &Set{want: want, link: link, adopt: adopt, log: log}
}

// Start makes every non-loopback wanted address local to this namespace: a
// predecessor's record of it is adopted (so it is removed when we stop), other
// addresses already present are left alone (and not recorded), missing ones
// are added (see ensureNodeAddrs).
func (n *Set) Start(context.Context) error {
	added, err := ensureNodeAddrs(n.want, n.link, n.adopt, n.log)
	n.added = added
	return err
}

// Handoff leaves the addresses to a successor.
func (n *Set) Handoff() { n.handoff = true }

// Close removes what Start added or adopted, unless handed off.
func (n *Set) Close() error {
	if n.handoff {
		return nil
	}
	err := Remove(records(n.added), n.log)
	n.added = nil
	return err
}

// Records are the state file's records of what the agent owns.
func (n *Set) Records() []agentstate.NodeAddr { return records(n.added) }

// Abandon removes only what this agent added itself, leaving what it adopted
// to the predecessor it failed to take over from.
func (n *Set) Abandon() error {
	var mine []agentstate.NodeAddr
	for _, na := range n.added {
		if !na.adopted {
			mine = append(mine, na.NodeAddr)
		}
	}
	n.added = nil
	return Remove(mine, n.log)
}

// ensureNodeAddrs makes every non-loopback listen address local to this namespace.
// An address present with a record in adopt is recorded as ours (adopted); other
// addresses already present are left alone (and not recorded). New ones go on a
// dummy link named linkName; where the kernel has no dummy link type they go on lo
// instead, and a log line says so.
func ensureNodeAddrs(addrs []netip.Addr, linkName string, adopt []agentstate.NodeAddr, log *slog.Logger) ([]owned, error) {
	var added []owned
	undo := func() {
		var mine []agentstate.NodeAddr
		for _, na := range added {
			if !na.adopted {
				mine = append(mine, na.NodeAddr)
			}
		}
		Remove(mine, log)
	}
	for _, a := range addrs {
		if a.IsLoopback() || a.IsUnspecified() {
			continue
		}
		local, err := isLocalAddr(a)
		if err != nil {
			undo()
			return nil, err
		}
		if local {
			if recs := adoptedRecords(adopt, a); len(recs) > 0 {
				for _, r := range recs {
					if !slices.ContainsFunc(added, func(x owned) bool {
						return x.Link == r.Link && x.Addr == r.Addr && x.CreatedLink == r.CreatedLink
					}) {
						added = append(added, r)
					}
				}
				log.Info("listen address adopted from the previous agent", "addr", a)
				continue
			}
			log.Info("listen address already present on this node", "addr", a)
			continue
		}
		link, created, err := resolverLink(linkName, log)
		if err != nil {
			undo()
			return nil, err
		}
		if created {
			// Record the link on its own, so that undo removes it even if the
			// address cannot be added.
			added = append(added, owned{NodeAddr: agentstate.NodeAddr{Link: link.Attrs().Name, CreatedLink: true}})
		}
		bits := 32
		if a.Is6() {
			bits = 128
		}
		prefix := netip.PrefixFrom(a, bits)
		nlAddr, err := netlink.ParseAddr(prefix.String())
		if err != nil {
			undo()
			return nil, fmt.Errorf("parse listen address %s: %w", prefix, err)
		}
		if a.Is6() {
			nlAddr.Flags = ifaNoDAD
		}
		if err := netlink.AddrAdd(link, nlAddr); err != nil {
			undo()
			return nil, fmt.Errorf("add %s to %s: %w", prefix, link.Attrs().Name, err)
		}
		added = append(added, owned{NodeAddr: agentstate.NodeAddr{Link: link.Attrs().Name, Addr: prefix.String()}})
		log.Info("added node-local resolver address", "addr", prefix, "link", link.Attrs().Name)
	}
	return added, nil
}

// resolverLink returns the dummy link, creating it, or lo when dummy links are not
// supported by this kernel.
func resolverLink(name string, log *slog.Logger) (netlink.Link, bool, error) {
	if l, err := netlink.LinkByName(name); err == nil {
		return l, false, nil
	}
	d := &netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Name: name}}
	err := netlink.LinkAdd(d)
	if err == nil {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return nil, false, fmt.Errorf("find created link %s: %w", name, err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			_ = netlink.LinkDel(l)
			return nil, false, fmt.Errorf("set %s up: %w", name, err)
		}
		return l, true, nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
		return nil, false, fmt.Errorf("create dummy link %s: %w", name, err)
	}
	log.Warn("this kernel has no dummy link type; putting the resolver address on lo instead", "link", name, "err", err)
	lo, lerr := netlink.LinkByName("lo")
	if lerr != nil {
		return nil, false, fmt.Errorf("find lo: %w", lerr)
	}
	return lo, false, nil
}

// removeNodeAddrs removes what ensureNodeAddrs added, in reverse order.
func Remove(added []agentstate.NodeAddr, log *slog.Logger) error {
	var errs []error
	for i := len(added) - 1; i >= 0; i-- {
		na := added[i]
		link, err := netlink.LinkByName(na.Link)
		if err != nil {
			continue // already gone
		}
		if na.CreatedLink {
			if err := netlink.LinkDel(link); err != nil {
				errs = append(errs, fmt.Errorf("delete link %s: %w", na.Link, err))
			}
			continue
		}
		addr, err := netlink.ParseAddr(na.Addr)
		if err != nil {
			errs = append(errs, fmt.Errorf("parse %s: %w", na.Addr, err))
			continue
		}
		if err := netlink.AddrDel(link, addr); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			errs = append(errs, fmt.Errorf("remove %s from %s: %w", na.Addr, na.Link, err))
			continue
		}
		log.Info("removed node-local resolver address", "addr", na.Addr, "link", na.Link)
	}
	return errors.Join(errs...)
}

// isLocalAddr reports whether a is assigned to an interface of this namespace.
func isLocalAddr(a netip.Addr) (bool, error) {
	ifaddrs, err := net.InterfaceAddrs()
	if err != nil {
		return false, fmt.Errorf("list addresses: %w", err)
	}
	for _, ia := range ifaddrs {
		if n, ok := ia.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a.Unmap() {
				return true, nil
			}
		}
	}
	return false, nil
}
