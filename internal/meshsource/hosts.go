package meshsource

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// entryHosts turns a ServiceEntry into the hosts the name table answers
// (docs/kubernetes.md, "ServiceEntries and remote clusters"):
//
//   - every host answers spec.addresses (IP addresses; CIDRs are not
//     answerable and are skipped, as Istio does);
//   - without them, the addresses Istio's allocator wrote to
//     status.addresses for that host;
//   - without either, a VIP the table allocates (240.240.0.0/16 and
//     2001:2::/48, in creation order), unless resolution is NONE (the
//     application's own destination is kept: nothing to answer) or the
//     host is a wildcard (a VIP for every name below it only with
//     DYNAMIC_DNS, as ztunnel does);
//   - exportTo decides which client namespaces see the hosts: absent or
//     "*" every client, "." the entry's own namespace, names those
//     namespaces, "~" none.
//
// No SRV or PTR beyond the addresses' PTR: Istio's DNS proxy answers A and
// AAAA only. Hosts that are not valid names are returned in bad (the rest
// is still answered).
func entryHosts(se *serviceEntry) (hosts []nametable.Host, bad []error) {
	visible, hidden := exportVisibility(se.exportTo, se.Namespace)
	if hidden {
		return nil, nil
	}
	resolution := strings.ToUpper(se.resolution)
	var extra *nametable.HostExtra // shared by the entry's hosts (the Builder copies it)
	if visible != nil || se.order != "" {
		extra = &nametable.HostExtra{Visible: visible, Order: se.order}
	}
	seen := map[string]bool{}
	for _, raw := range se.hosts {
		name, err := nametable.NormName(raw)
		if err != nil {
			bad = append(bad, fmt.Errorf("host %q: %w", raw, err))
			continue
		}
		if seen[name] {
			continue
		}
		seen[name] = true
		h := nametable.Host{Name: name, Extra: extra}
		wildcard := strings.HasPrefix(name, "*.")
		switch {
		case len(se.addrs) > 0:
			splitAddrs(&h, se.addrs)
		case hasStatusAddrs(se.status, name):
			for _, s := range se.status {
				if s.host == "" || s.host+"." == name {
					splitAddrs(&h, []netip.Addr{s.addr})
				}
			}
		case resolution == "" || resolution == "NONE":
			continue
		case wildcard && resolution != "DYNAMIC_DNS":
			continue
		default:
			h.NeedVIP = true
		}
		hosts = append(hosts, h)
	}
	return hosts, bad
}

func hasStatusAddrs(status []statusAddr, name string) bool {
	return slices.ContainsFunc(status, func(s statusAddr) bool { return s.host == "" || s.host+"." == name })
}

// exportVisibility maps exportTo to nametable.HostExtra.Visible: nil for every
// client; hidden when the entry is exported nowhere.
func exportVisibility(exportTo []string, namespace string) (visible []string, hidden bool) {
	if len(exportTo) == 0 {
		return nil, false // Istio's default (defaultServiceExportTo "*")
	}
	for _, e := range exportTo {
		switch e = strings.TrimSpace(e); e {
		case "*":
			return nil, false
		case "~":
			continue
		case ".":
			visible = append(visible, namespace)
		default:
			visible = append(visible, e)
		}
	}
	if len(visible) == 0 {
		return nil, true
	}
	return visible, false
}

func splitAddrs(h *nametable.Host, addrs []netip.Addr) {
	for _, a := range addrs {
		if a.Is4() {
			if !slices.Contains(h.V4, a) {
				h.V4 = append(h.V4, a)
			}
		} else if !slices.Contains(h.V6, a) {
			h.V6 = append(h.V6, a)
		}
	}
}
