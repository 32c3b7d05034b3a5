package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"

	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/captureplan"
	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// startPlan is what Start resolves, from the validated Config and the host,
// before it acquires anything: the capture mode, what is captured and on
// which slot ports, where the resolver listens, and where it forwards. It is
// read-only once resolvePlan returns; the Config itself is never written
// after Validate.
type startPlan struct {
	mode, reason string
	kubeRest     *rest.Config     // the Kubernetes API server; nil without the source
	nameservers  []netip.Addr     // captured (flags, the cluster DNS Service or resolv.conf), our own addresses removed
	upstreams    []netip.AddrPort // forwarded to, our own slot addresses removed
	capture      captureplan.Plan // the zero Plan in off mode
	ports        []uint16         // slot ports; [0] (each listen address's own port) in off mode
	listenAddrs  []string         // the resolver's addresses: every listen address on every slot port
	cgroup       string           // eBPF mode: the cgroup v2 directory attached to
}

// resolvePlan resolves the start plan: the Kubernetes connection (and the
// cluster DNS Service to capture), the nameservers and upstreams, the
// capture plan, the mode (auto picks one) and the privileges it needs.
func (c *Config) resolvePlan(ctx context.Context, log *slog.Logger) (*startPlan, error) {
	p := &startPlan{}
	nameservers := c.Nameservers
	if c.Kubernetes() {
		var err error
		if p.kubeRest, nameservers, err = c.setupKubernetes(ctx, log); err != nil {
			return nil, err
		}
	}
	var err error
	if p.nameservers, p.upstreams, p.capture, err = c.resolveServers(nameservers, log); err != nil {
		return nil, err
	}
	p.ports = []uint16{0}
	if c.Mode != ModeOff {
		p.ports = p.capture.Ports(c.basePort())
	}
	if err := checkPrivileges(c.Mode, c.IptablesBackend, p.ports); err != nil {
		return nil, err
	}
	if p.mode, p.reason, err = c.pickMode(log); err != nil {
		return nil, err
	}
	if p.mode != c.Mode {
		if err := checkPrivileges(p.mode, c.IptablesBackend, p.ports); err != nil {
			return nil, err
		}
	}
	for _, l := range c.Listen {
		for _, port := range p.ports {
			if port == 0 {
				port = l.Port()
			}
			p.listenAddrs = append(p.listenAddrs, netip.AddrPortFrom(l.Addr(), port).String())
		}
	}
	if p.mode == ModeEBPF {
		if p.cgroup = c.Cgroup; p.cgroup == "" {
			if p.cgroup, err = cgroup2.FindMount(); err != nil {
				return nil, fmt.Errorf("find the cgroup2 root: %w", err)
			}
		}
	}
	return p, nil
}

// resolveServers completes the nameservers to capture (given: the flag's
// or the cluster DNS Service's; nil: resolv.conf's) and the upstreams (the
// flag's, else resolv.conf's), removes our own addresses from both, and
// makes the capture plan (off mode: none).
func (c *Config) resolveServers(given []netip.Addr, log *slog.Logger) ([]netip.Addr, []netip.AddrPort, captureplan.Plan, error) {
	var none captureplan.Plan
	nameservers, upstreams := slices.Clone(given), slices.Clone(c.Upstreams)
	needNS := nameservers == nil && c.Mode != ModeOff
	if needNS || len(upstreams) == 0 {
		servers, _, err := upstream.ParseResolvConf(c.ResolvConf)
		if err != nil {
			return nil, nil, none, fmt.Errorf("read nameservers: %w", err)
		}
		if needNS {
			for _, s := range servers {
				nameservers = append(nameservers, s.Addr())
			}
		}
		if len(upstreams) == 0 {
			upstreams = servers
		}
	}
	// Never capture our own listen addresses.
	nameservers = slices.DeleteFunc(nameservers, func(n netip.Addr) bool {
		return slices.ContainsFunc(c.Listen, func(l netip.AddrPort) bool { return l.Addr() == n })
	})
	plan := none
	if c.Mode != ModeOff && (len(nameservers) > 0 || c.CaptureAll) {
		var err error
		if plan, err = captureplan.New(nameservers, c.CaptureAll); err != nil {
			return nil, nil, none, err
		}
	}
	// Never forward to ourselves: our listen addresses on any slot port.
	// Another port on the same address is someone else's server and fine.
	upstreams = slices.DeleteFunc(upstreams, func(u netip.AddrPort) bool {
		if plan.Owns(c.Listen, u) {
			log.Warn("ignoring upstream that is our own listen address", "upstream", u)
			return true
		}
		return false
	})
	if len(upstreams) == 0 {
		return nil, nil, none, fmt.Errorf("no upstream nameserver: give --upstream or a nameserver in %s", c.ResolvConf)
	}
	if c.Mode != ModeOff && len(nameservers) == 0 && !c.CaptureAll {
		return nil, nil, none, fmt.Errorf("nothing to capture: no nameserver in %s and no --nameservers (or use --capture-all)", c.ResolvConf)
	}
	if !c.CaptureLoopback && !c.CaptureAll {
		for _, n := range nameservers {
			if n.IsLoopback() {
				log.Warn("nameserver is a loopback address and is not captured without --capture-loopback", "nameserver", n)
			}
		}
	}
	return nameservers, upstreams, plan, nil
}

// basePort is the port of slot 0, as the eBPF datapath takes it: the IPv4
// listen port, else the IPv6 one.
func (c *Config) basePort() uint16 {
	v4, v6 := c.targets()
	if v4.IsValid() {
		return v4.Port()
	}
	return v6.Port()
}
