package agent

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/meshsource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/names/filesource"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/ndssource"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// pickMode resolves auto into ebpf or iptables and checks a forced mode can work.
func (c *Config) pickMode(log *slog.Logger) (mode, reason string, err error) {
	switch c.Mode {
	case ModeOff:
		return ModeOff, "requested: resolver only, no capture", nil
	case ModeIptables:
		if err := ctzone.Probe(c.IptablesBackend); err != nil {
			return "", "", fmt.Errorf("--mode iptables cannot work here: %w", err)
		}
		return ModeIptables, "requested", nil
	}
	probeErr := c.probeEBPF()
	if probeErr == nil && !hasCap(capBPF) {
		probeErr = errors.New("CAP_BPF is missing")
	}
	if c.Mode == ModeEBPF {
		// A forced mode that cannot work fails here, before anything is installed.
		if probeErr != nil {
			return "", "", fmt.Errorf("--mode ebpf cannot work here: %w", probeErr)
		}
		return ModeEBPF, "requested", nil
	}
	if probeErr == nil {
		return ModeEBPF, "auto: the kernel has every eBPF hook the datapath needs", nil
	}
	log.Warn("eBPF capture unavailable, falling back to iptables with conntrack zones", "reason", probeErr)
	if err := ctzone.Probe(c.IptablesBackend); err != nil {
		return "", "", fmt.Errorf("auto mode: eBPF unavailable (%v) and iptables unavailable: %w", probeErr, err)
	}
	return ModeIptables, "auto: eBPF unavailable: " + probeErr.Error(), nil
}

func (c *Config) probeEBPF() error {
	if c.forceNoEBPF != "" {
		return fmt.Errorf("forced probe failure: %s", c.forceNoEBPF)
	}
	f, err := redirect.Probe()
	if err != nil {
		return err
	}
	if missing := f.Missing(); len(missing) > 0 {
		return fmt.Errorf("kernel lacks %v", missing)
	}
	return nil
}

// redirectConfig is the eBPF datapath's configuration in plan p.
func (c *Config) redirectConfig(p *startPlan, log *slog.Logger) redirect.Config {
	rc := redirect.Config{
		Cgroup:          p.cgroup,
		PinDir:          c.BPFFS,
		Nameservers:     p.nameservers,
		CaptureAll:      c.CaptureAll,
		CaptureLoopback: c.CaptureLoopback,
		ProxyUIDs:       c.ProxyUIDs,
		UpstreamMark:    c.UpstreamMark,
		Attribution:     c.Workloads.Attribution,
		EgressGrants:    c.Egress.MaxGrants,
		Detach:          !c.Persist,
		Logger:          log.With("component", "redirect"),
	}
	rc.Target4, rc.Target6 = c.targets()
	return rc
}

// targets splits the listen addresses by family (Validate allows one of each).
func (c *Config) targets() (v4, v6 netip.AddrPort) {
	for _, l := range c.Listen {
		if l.Addr().Is4() {
			v4 = l
		} else {
			v6 = l
		}
	}
	return v4, v6
}

// ctzoneConfig is the iptables datapath's configuration in plan p.
func (c *Config) ctzoneConfig(p *startPlan, log *slog.Logger) ctzone.Config {
	cc := ctzone.Config{
		Nameservers:  p.nameservers,
		CaptureAll:   c.CaptureAll,
		ProxyUIDs:    c.ProxyUIDs,
		ProxyGIDs:    c.ProxyGIDs,
		UpstreamMark: c.UpstreamMark,
		Backend:      c.IptablesBackend,
		Logger:       log.With("component", "ctzone"),
	}
	cc.ListenAddr, cc.ListenAddr6 = c.targets()
	return cc
}

// addIstiodSource adds the NDS source (--istiod): one view for the
// agent's namespace and, in node mode, one per namespace of this node's
// Pods, which the Kubernetes source knows.
func (c *Config) addIstiodSource(store *names.Store, local *kubesource.Source, reg prometheus.Registerer, log *slog.Logger) error {
	ic := c.Istiod
	if ic.Addr == "" {
		return nil
	}
	ns, err := c.Mesh.ownNamespace(c.InCluster)
	if err != nil {
		return fmt.Errorf("--istiod: %w", err)
	}
	if ic.ProxyName == "" && c.NodeName != "" {
		ic.ProxyName = "meshdns-ebpf-" + c.NodeName
	}
	m, err := ndssource.NewMetrics(reg)
	if err != nil {
		return err
	}
	cfg := ndssource.Config{
		Addr: ic.Addr, CAFile: ic.CAFile, TokenFile: ic.TokenFile, SAN: ic.SAN, ClusterID: ic.ClusterID,
		Domain: c.ClusterDomain, ProxyName: ic.ProxyName, Namespace: ns, Metrics: m,
		Logger: log.With("component", "names"),
	}
	for _, l := range c.Listen {
		cfg.ProxyIPs = append(cfg.ProxyIPs, l.Addr())
	}
	// Node views by default where istiod can serve them: over TLS its
	// identity check lets the agent's token claim its own namespace only.
	view := ic.View
	if view == "" && local != nil && c.NodeName != "" && ic.CAFile == "" {
		view = IstiodViewNode
	}
	if view == IstiodViewNode {
		cfg.Namespaces = func() []string {
			var out []string
			for _, p := range local.Pods() {
				if !slices.Contains(out, p.Namespace) {
					out = append(out, p.Namespace)
				}
			}
			return out
		}
	}
	src, err := ndssource.New(cfg)
	if err != nil {
		return err
	}
	log.Info("istiod name source", "istiod", ic.Addr, "tls", ic.CAFile != "", "view", cmp.Or(view, IstiodViewAgent), "namespace", ns)
	return store.Add(src, names.SourceOptions{Priority: names.PriorityIstiod})
}

// newNameStore creates the name store with the configured sources: the
// names file, the Kubernetes API server, or the embedded demo table when
// no other source is given. local is the Kubernetes source (nil without
// one): it knows the Pods of this node; entries the ServiceEntry source (nil
// without one).
func (c *Config) newNameStore(reg prometheus.Registerer, kubeRest *rest.Config, largeChange func(begins bool), log *slog.Logger) (store *names.Store, local *kubesource.Source, entries *meshsource.ServiceEntries, err error) {
	m, err := names.NewMetrics(reg)
	if err != nil {
		return nil, nil, nil, err
	}
	store, err = names.New(names.Config{
		Table:       nametable.Options{ClusterDomain: c.ClusterDomain, TTL: c.TTL},
		Logger:      log.With("component", "names"),
		Metrics:     m,
		LargeChange: largeChange,
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("name store: %w", err)
	}
	if c.NamesFile != "" {
		f, err := filesource.NewFile(c.NamesFile, filesource.Options{Domain: store.Domain(), Logger: log.With("component", "names"),
			LargeChange: largeChange})
		if err != nil {
			return nil, nil, nil, err
		}
		// The first load must succeed: a bad file at start is bad input, not
		// something to serve around. Later bad files keep the last good
		// table serving.
		if err := f.Check(); err != nil {
			return nil, nil, nil, err
		}
		if err := store.Add(f, names.SourceOptions{Priority: names.PriorityFile}); err != nil {
			return nil, nil, nil, err
		}
	}
	if kubeRest != nil {
		ks, err := kubesource.New(kubesource.Config{
			Name: "kubernetes", Rest: kubeRest, Domain: c.ClusterDomain, NodeName: c.NodeName,
			Logger: log.With("component", "names"),
		})
		if err != nil {
			return nil, nil, nil, err
		}
		if err := store.Add(ks, names.SourceOptions{Priority: names.PriorityKubernetes}); err != nil {
			return nil, nil, nil, err
		}
		local = ks
	}
	if entries, err = c.addMeshSources(store, kubeRest, log); err != nil {
		return nil, nil, nil, err
	}
	if err := c.addIstiodSource(store, local, reg, log); err != nil {
		return nil, nil, nil, err
	}
	if err := c.addFaultSources(store); err != nil {
		return nil, nil, nil, err
	}
	if c.NamesFile == "" && kubeRest == nil && !c.meshSources() && c.Istiod.Addr == "" {
		demo, err := filesource.NewStatic("demo", defaultNames, store.Domain())
		if err != nil {
			return nil, nil, nil, err
		}
		if err := store.Add(demo, names.SourceOptions{Priority: names.PriorityDemo}); err != nil {
			return nil, nil, nil, err
		}
		log.Info("using the embedded demo name table (give --names FILE for your own)")
	}
	return store, local, entries, nil
}
