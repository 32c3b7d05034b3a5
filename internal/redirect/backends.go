package redirect

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
)

// Backend capture. Where another datapath's socket load balancer runs before
// ours (a kernel without ordered cgroup programs, or one attached in front of
// ours later), a query to the kube-dns ClusterIP reaches our programs with a
// CoreDNS pod's address as destination. The agent gives the datapath those
// backends (the cluster DNS Service's EndpointSlice addresses); the programs
// capture a query to one like a query to its nameserver, record the
// nameserver as the original destination, and so restore the address the
// client asked on recvmsg and getpeername, whatever order the other
// datapath's recvmsg runs in. A backend served in the sender's own network
// namespace (a CoreDNS pod asking itself) is not captured.

// maxBackends is the size of the backends map (MAX_BACKENDS).
const maxBackends = int(redirectMeshdnsLimitsMAX_BACKENDS)

// SetBackends sets the backends of the captured nameservers: backend address
// -> the nameserver it serves (of the same family). Backends of a nameserver
// that is not captured are left out. It may be called before Start (the
// backends are written when the maps are) and any time after; each call
// replaces the previous set.
func (d *Datapath) SetBackends(backends map[netip.Addr]netip.Addr) error {
	want := map[redirectNsKey]redirectBackend{}
	var skipped []string
	for be, ns := range backends {
		be, ns = be.Unmap(), ns.Unmap()
		slot := slices.Index(d.set.nameservers, ns)
		if slot < 0 || be.Is4() != ns.Is4() || slices.Contains(d.set.nameservers, be) {
			skipped = append(skipped, be.String())
			continue
		}
		if len(want) == maxBackends {
			skipped = append(skipped, be.String())
			continue
		}
		want[redirectNsKey{Addr: addrWords(be)}] = redirectBackend{Nameserver: addrWords(ns), Slot: uint32(slot)}
	}
	if len(skipped) > 0 {
		d.log.Warn("backends not captured: their nameserver is not captured, of another family, itself a nameserver, or past the limit",
			"backends", skipped, "limit", maxBackends)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.backends = want
	if d.objs.Backends == nil {
		return nil
	}
	return d.writeBackends()
}

// writeBackends makes the backends map hold d.backends, with d.mu held. Before
// the first SetBackends it leaves the map as it is: a successor keeps its
// predecessor's backends until its own Kubernetes watch has them.
func (d *Datapath) writeBackends() error {
	if d.backends == nil {
		return nil
	}
	var (
		key  redirectNsKey
		val  redirectBackend
		gone []redirectNsKey
		errs []error
	)
	it := d.objs.Backends.Iterate()
	for it.Next(&key, &val) {
		if _, ok := d.backends[key]; !ok {
			gone = append(gone, key)
		}
	}
	for k, v := range d.backends {
		if err := d.objs.Backends.Put(&k, &v); err != nil {
			errs = append(errs, fmt.Errorf("write backend to map: %w", err))
		}
	}
	for _, k := range gone {
		if err := d.objs.Backends.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("delete backend from map: %w", err))
		}
	}
	return errors.Join(errs...)
}
