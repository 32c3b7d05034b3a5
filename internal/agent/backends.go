package agent

import (
	"net/netip"
)

// watchDNSBackends feeds the datapath the cluster DNS Service's endpoint
// addresses (its CoreDNS pods) from the Kubernetes source's watch, each
// mapped to the captured cluster IP of its family: where another datapath's
// socket load balancer runs before ours, that is the destination our programs
// see (redirect.Datapath.SetBackends). Only when the captured nameservers are
// that Service's cluster IPs (no --nameservers).
func (a *Agent) watchDNSBackends() {
	if a.pods == nil || a.dp == nil || a.cfg.Nameservers != nil {
		return
	}
	var v4, v6 netip.Addr
	for _, ns := range a.plan.nameservers {
		switch {
		case ns.Unmap().Is4() && !v4.IsValid():
			v4 = ns.Unmap()
		case !ns.Unmap().Is4() && !v6.IsValid():
			v6 = ns
		}
	}
	dp, log := a.dp, a.log
	a.pods.WatchServiceBackends(a.cfg.ClusterDNSService, func(addrs []netip.Addr) {
		backends := map[netip.Addr]netip.Addr{}
		for _, b := range addrs {
			ns := v6
			if b = b.Unmap(); b.Is4() {
				ns = v4
			}
			if ns.IsValid() {
				backends[b] = ns
			}
		}
		if err := dp.SetBackends(backends); err != nil {
			log.Warn("cannot write the cluster DNS Service's backends to the datapath", "err", err)
			return
		}
		log.Info("cluster DNS Service backends captured after another datapath's translation", "backends", len(backends))
	})
}
