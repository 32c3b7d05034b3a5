package agent

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/egressctl"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy/policyfile"
	"github.com/meshdns/meshdns-ebpf/internal/istioegress"
	"github.com/meshdns/meshdns-ebpf/internal/kubeegress"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// EgressConfig is DNS-gated egress (docs/egress.md). The flag names are a
// contract.
type EgressConfig struct {
	Enabled        bool           // --egress
	PolicyFile     string         // --egress-policy-file
	Internal       []netip.Prefix // --egress-internal-cidrs
	Grace          time.Duration  // --egress-grace
	MaxGrants      int            // --egress-max-grants
	WorkloadGrants int            // --egress-workload-grants
	internal       string         // the flag's text
}

func (c *Config) registerEgressFlags(fs *flag.FlagSet) {
	e := &c.Egress
	fs.BoolVar(&e.Enabled, "egress", false, "enforce DNS egress policies (eBPF mode): a workload a policy selects connects only to addresses that a name it may use resolved to; policies from DNSEgressPolicy resources and Istio's REGISTRY_ONLY (with a Kubernetes source) and --egress-policy-file")
	fs.StringVar(&e.PolicyFile, "egress-policy-file", "", "egress policies of this host's systemd units or cgroups, YAML, reloaded live (needs --egress)")
	fs.StringVar(&e.internal, "egress-internal-cidrs", "", "cluster-internal destinations (the Pod and Service CIDRs), comma-separated: allowed without a grant unless a policy puts them in scope")
	fs.DurationVar(&e.Grace, "egress-grace", egress.DefaultGrace, "added to each answer's TTL for its grant: a client that connects as the answer expires still may")
	fs.IntVar(&e.MaxGrants, "egress-max-grants", redirect.DefaultEgressGrants, "the most grants (workload, address) the node holds: the grant map's size")
	fs.IntVar(&e.WorkloadGrants, "egress-workload-grants", 0, "the most grants one workload holds; over it its own grant closest to expiry gives way, never another workload's (0: a sixteenth of --egress-max-grants)")
}

// validateEgress checks the egress flags and parses the internal prefixes.
func (c *Config) validateEgress() error {
	e := &c.Egress
	e.Internal = nil
	for _, s := range strings.Split(e.internal, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return fmt.Errorf("--egress-internal-cidrs: %q is not a prefix (10.244.0.0/16): %w", s, err)
		}
		e.Internal = append(e.Internal, p.Masked())
	}
	switch {
	case !e.Enabled && (e.PolicyFile != "" || len(e.Internal) > 0):
		return fmt.Errorf("--egress-policy-file and --egress-internal-cidrs need --egress")
	case e.Enabled && c.Mode != ModeAuto && c.Mode != ModeEBPF:
		return fmt.Errorf("--egress needs the eBPF datapath: --mode %s cannot enforce at the socket", c.Mode)
	case e.Grace < 0 || e.MaxGrants <= 0 || e.WorkloadGrants < 0 || e.WorkloadGrants > e.MaxGrants:
		return fmt.Errorf("--egress-grace %s, --egress-max-grants %d, --egress-workload-grants %d: want a grace >= 0 and 0 <= workload grants <= max grants > 0",
			e.Grace, e.MaxGrants, e.WorkloadGrants)
	}
	return nil
}

// egressPart is the agent's DNS-gated egress: the datapath's maps, the
// controller and the policy sources.
type egressPart struct {
	eg      *egress.Egress
	ctl     *egressctl.Controller
	sources []interface{ Close() error }
	stop    context.CancelFunc
}

// startEgress starts DNS-gated egress (--egress, eBPF mode): the egress
// maps (adopting a predecessor's grants and workloads), the controller, and
// the policy sources, which publish to it. It comes after the datapath and
// before the resolver, whose answers it grants.
func (a *Agent) startEgress(ctx context.Context, reg *prometheus.Registry) (err error) {
	ec := a.cfg.Egress
	if !ec.Enabled {
		return nil
	}
	if a.dp == nil {
		return fmt.Errorf("--egress needs the eBPF datapath, and the capture mode is %s", a.plan.mode)
	}
	p := &egressPart{}
	a.egress = p
	log := a.log.With("component", "egress")
	if p.eg, err = egress.New(egress.Config{Datapath: a.dp, Grace: ec.Grace, Quota: ec.WorkloadGrants, Logger: log}); err != nil {
		return err
	}
	if err := p.eg.Start(ctx); err != nil {
		return err
	}
	mount, err := cgroup2.FindMount()
	if err != nil {
		return fmt.Errorf("egress: %w", err)
	}
	cfg := egressctl.Config{Datapath: p.eg, Grants: p.eg.Grants(), CgroupRoot: a.plan.cgroup, UnitRoot: mount, Internal: ec.Internal,
		Adopted: p.eg.Workloads(), Expect: a.egressSources(), Logger: log}
	if a.pods != nil {
		cfg.Pods = a.egressPods
	}
	if p.ctl, err = egressctl.New(cfg); err != nil {
		return err
	}
	if err := p.ctl.Start(ctx); err != nil {
		return err
	}
	if a.pods != nil {
		a.pods.OnPods(p.ctl.PodsChanged) // a new pod's cgroup is looked for at once, not at the next resync
	}
	reg.MustRegister(egressctl.NewCollector(p.ctl, p.eg, a.cfg.Workloads.TopK))
	evctx, cancel := context.WithCancel(context.Background())
	p.stop = cancel
	go p.ctl.ForwardEvents(evctx, p.eg.Events(), a.work.hub)
	if err := a.startEgressSources(ctx, reg, p, log); err != nil {
		return err
	}
	return a.waitEgressPolicies(ctx, p, len(cfg.Adopted) > 0, log)
}

// egressSources are the policy sources the controller waits for: the policy
// file, and the DNSEgressPolicy source with a Kubernetes source (Istio's
// REGISTRY_ONLY publishes only where Istio's CRDs are installed, so it is not
// waited for).
func (a *Agent) egressSources() []string {
	var srcs []string
	if a.cfg.Egress.PolicyFile != "" {
		srcs = append(srcs, "file")
	}
	if a.plan.kubeRest != nil {
		srcs = append(srcs, "kubernetes")
	}
	return srcs
}

// egressPolicyWait bounds how long a restarted agent (one that adopted selected
// workloads) waits for its policy sources before its resolver serves.
const egressPolicyWait = 10 * time.Second

// waitEgressPolicies holds the start of a restarted agent until its policy
// sources have published: its resolver then grants every answer to a selected
// workload by that workload's policy from the first (a takeover's predecessor
// serves meanwhile). Past egressPolicyWait it goes on, and says so.
func (a *Agent) waitEgressPolicies(ctx context.Context, p *egressPart, adopted bool, log *slog.Logger) error {
	if !adopted {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, egressPolicyWait)
	defer cancel()
	start := time.Now()
	if !p.ctl.WaitPublished(wctx) {
		if err := ctx.Err(); err != nil {
			return err
		}
		log.Warn("egress policy sources not all published; serving with the workloads a previous agent left", "waited", egressPolicyWait)
		return nil
	}
	if err := p.ctl.Sync(); err != nil {
		return err
	}
	log.Info("egress policies published", "waited", time.Since(start).Round(time.Millisecond))
	return nil
}

// startEgressSources starts the policy file and, with a Kubernetes source,
// the DNSEgressPolicy and Istio REGISTRY_ONLY sources.
func (a *Agent) startEgressSources(ctx context.Context, reg *prometheus.Registry, p *egressPart, log *slog.Logger) error {
	publish := func(source string) func(*egresspolicy.Set) {
		return func(s *egresspolicy.Set) { p.ctl.SetPolicies(source, s) }
	}
	ec := a.cfg.Egress
	if ec.PolicyFile != "" {
		fs, err := policyfile.New(ec.PolicyFile, policyfile.Options{OnChange: publish("file"), Registerer: reg, Logger: a.log.With("component", "egress-file")})
		if err != nil {
			return err
		}
		p.sources = append(p.sources, fs)
		if err := fs.Start(ctx); err != nil {
			return fmt.Errorf("egress policy file: %w", err)
		}
	}
	if rc := a.plan.kubeRest; rc != nil {
		ks, err := kubeegress.New(rc, kubeegress.Options{OnChange: publish("kubernetes"), WriteStatus: true, Node: a.cfg.NodeName,
			Registerer: reg, Logger: a.log.With("component", "egress-kubernetes")})
		if err != nil {
			return err
		}
		p.sources = append(p.sources, ks)
		if err := ks.Start(ctx); err != nil {
			return fmt.Errorf("DNSEgressPolicy source: %w", err)
		}
		if a.entries != nil { // REGISTRY_ONLY needs the ServiceEntries (--service-entries)
			is, err := istioegress.New(rc, istioegress.Options{ServiceEntries: a.entries, OnChange: publish("istio"),
				Domain: a.cfg.ClusterDomain, Logger: a.log.With("component", "egress-istio")})
			if err != nil {
				return err
			}
			p.sources = append(p.sources, is)
			if err := is.Start(ctx); err != nil {
				return fmt.Errorf("istio REGISTRY_ONLY source: %w", err)
			}
		}
	}
	log.Info("egress policies enforced", "policy_file", ec.PolicyFile, "kubernetes", a.plan.kubeRest != nil,
		"internal", ec.Internal, "grace", ec.Grace)
	return nil
}

// egressPods is this node's pods as the egress controller selects them.
func (a *Agent) egressPods() []egressctl.Pod {
	refs := a.pods.Pods()
	out := make([]egressctl.Pod, 0, len(refs))
	for _, r := range refs {
		out = append(out, egressctl.Pod{Namespace: r.Namespace, Name: r.Name, UID: r.UID, Labels: r.Labels})
	}
	return out
}

// close stops the sources, the controller and the event reader. The pinned
// maps keep enforcing for the next agent (or are removed with the datapath's
// pins on uninstall).
func (p *egressPart) close(add func(string, error)) {
	if p == nil {
		return
	}
	for _, s := range p.sources {
		add("egress policy source", s.Close())
	}
	if p.ctl != nil {
		add("egress controller", p.ctl.Close())
	}
	if p.stop != nil {
		p.stop()
	}
	if p.eg != nil {
		add("egress datapath", p.eg.Close())
	}
}
