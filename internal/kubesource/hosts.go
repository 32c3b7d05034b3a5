package kubesource

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// serviceHosts turns a Service and its EndpointSlices into the hosts the
// name table answers, following the Kubernetes DNS specification
// (docs/kubernetes.md):
//
//   - ClusterIP: <svc>.<ns>.svc.<domain> A/AAAA for every cluster IP, SRV
//     _<port>._<proto> for every named port, PTR for the cluster IPs.
//   - ExternalName: a CNAME to the external name.
//   - Headless: the Service name answers the ready endpoints (every
//     endpoint with publishNotReadyAddresses); each endpoint has a name of
//     its own, <hostname>.<svc>.<ns>.svc.<domain> or, without a hostname,
//     <a-b-c-d>.<svc>.<ns>.svc.<domain>, with its PTR; SRV has one record
//     per endpoint and named port, targeting the endpoint's name. No ready
//     endpoint: no names (NXDOMAIN, as CoreDNS).
//
// domain is the cluster domain with the trailing dot. Headless hosts are
// Merge hosts, so the same Service in several clusters answers the union.
func serviceHosts(domain string, svc *service, eps []*endpointSlice) []nametable.Host {
	name := svc.Name + "." + svc.Namespace + ".svc." + domain
	switch {
	case svc.externalName != "":
		return []nametable.Host{{Name: name, Kubernetes: true, Extra: &nametable.HostExtra{CNAME: svc.externalName}}}
	case !svc.headless:
		h := nametable.Host{Name: name, Kubernetes: true, Ports: hostPorts(svc.ports)}
		if len(svc.clusterIPs) == 1 && svc.clusterIPs[0].Is4() {
			h.V4 = svc.clusterIPs // shared with the informer's object: both immutable
		} else {
			splitAddrs(&h, svc.clusterIPs)
		}
		return []nametable.Host{h}
	}

	svcHost := nametable.Host{Name: name, Kubernetes: true, Merge: true, NoPTR: true}
	var epHosts []nametable.Host
	byLabel := map[string]int{} // endpoint label -> index in epHosts
	seen := map[netip.Addr]bool{}
	// Slices in name order, so the answer order does not depend on the
	// order events came in.
	eps = slices.Clone(eps)
	slices.SortFunc(eps, func(a, b *endpointSlice) int { return strings.Compare(a.Name, b.Name) })
	for _, es := range eps {
		for _, ep := range es.endpoints {
			if !ep.ready && !svc.publishNotReady {
				continue
			}
			// The addresses not seen before: the informer's object's own
			// slice up to the first repeat (the table keeps one copy), a
			// copy only when an address repeats.
			n := 0
			for _, a := range ep.addrs {
				if seen[a] {
					break
				}
				seen[a] = true
				n++
			}
			fresh := ep.addrs[:n:n]
			for _, a := range ep.addrs[n:] {
				if !seen[a] {
					seen[a] = true
					fresh = append(fresh, a)
				}
			}
			if len(fresh) == 0 {
				continue // the same endpoint in two slices during an update
			}
			label := ep.hostname
			if label == "" {
				label = dashed(fresh[0])
			}
			epName := label + "." + name
			i, ok := byLabel[label]
			if !ok {
				i = len(epHosts)
				byLabel[label] = i
				epHosts = append(epHosts, nametable.Host{Name: epName, Merge: true})
			}
			splitAddrs(&epHosts[i], fresh)
			splitAddrs(&svcHost, fresh)
			for _, p := range es.ports {
				hp := nametable.HostPort{Name: p.name, Protocol: p.proto, Port: p.port, Target: epName}
				if !slices.Contains(svcHost.Ports, hp) {
					svcHost.Ports = append(svcHost.Ports, hp)
				}
			}
		}
	}
	return append([]nametable.Host{svcHost}, epHosts...)
}

// hostPorts turns a Service's ports into SRV ports of the Service itself,
// shared between every Service with the same ports (the table keeps them
// and never changes them).
func hostPorts(ps []port) []nametable.HostPort {
	if len(ps) == 0 {
		return nil
	}
	intern.Lock()
	defer intern.Unlock()
	if hp, ok := intern.hostPorts[&ps[0]]; ok && len(hp) == len(ps) {
		return hp
	}
	hp := make([]nametable.HostPort, len(ps))
	for i, p := range ps {
		hp[i] = nametable.HostPort{Name: p.name, Protocol: p.proto, Port: p.port}
	}
	if len(intern.hostPorts) < 1<<16 {
		intern.hostPorts[&ps[0]] = hp
	}
	return hp
}

// splitAddrs adds addrs to h's V4 and V6. A host that has none yet shares
// addrs when they are all of one family (the common endpoint: one address;
// the table never changes them, and the capacity is cut so that a later
// append copies).
func splitAddrs(h *nametable.Host, addrs []netip.Addr) {
	if len(h.V4)+len(h.V6) == 0 && len(addrs) > 0 {
		v4 := 0
		for _, a := range addrs {
			if a.Is4() {
				v4++
			}
		}
		switch v4 {
		case len(addrs):
			h.V4 = addrs[:len(addrs):len(addrs)]
			return
		case 0:
			h.V6 = addrs[:len(addrs):len(addrs)]
			return
		}
	}
	for _, a := range addrs {
		if a.Is4() {
			h.V4 = append(h.V4, a)
		} else {
			h.V6 = append(h.V6, a)
		}
	}
}

// dashed is the label of an endpoint without a hostname: its address with
// '-' for '.' or ':' (10-244-1-5, fd00-10--5), as CoreDNS names them.
func dashed(a netip.Addr) string {
	if a.Is4() {
		return strings.ReplaceAll(a.String(), ".", "-")
	}
	s := strings.ReplaceAll(a.String(), ":", "-")
	if strings.HasPrefix(s, "-") || strings.HasSuffix(s, "-") {
		// "::1" would start a label with '-': spell it out.
		s = strings.ReplaceAll(a.StringExpanded(), ":", "-")
	}
	return s
}
