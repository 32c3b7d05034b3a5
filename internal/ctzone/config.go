// Package ctzone is meshdns-ebpf's iptables fallback datapath. It captures DNS
// (UDP and TCP port 53) to the resolver with nat-table DNAT rules and keeps the
// captured flows in a conntrack zone of their own with raw-table CT rules, so
// that a captured query never shares a conntrack entry with an uncaptured flow of
// the same 4-tuple (the resolver's or a proxy's own upstream query). Without the
// zone, conntrack reuses the NAT decision of whichever flow came first and a
// query is sent the wrong way (Istio issue 33469). It also inspects and flushes
// the conntrack entries involved, through ctnetlink.
//
// Everything lives in chains named MESHDNS-*, each jumped to from one built-in
// chain by one rule; Rules.Start is idempotent and repairs drift until Close, Rules.Close
// and Cleanup remove all of it. The rules are programmed in the network
// namespace Start was called from (or Config.Netns), with the iptables backend
// (legacy or nft) the host already uses. docs/iptables-mode.md shows the rules.
package ctzone

import (
	"errors"
	"fmt"
	"github.com/meshdns/meshdns-ebpf/internal/captureplan"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"time"
)

// Backends.
const (
	BackendLegacy = "legacy"
	BackendNFT    = "nft"
)

// Defaults.
const (
	DefaultUpstreamMark  = 0x3f53
	DefaultZone          = 0x3f53 // 16211
	DefaultCheckInterval = 5 * time.Second
	// commentTag marks the jump rules we insert into built-in chains.
	commentTag = "meshdns-ebpf"
	// chainPrefix starts the name of every chain of ours.
	chainPrefix = "MESHDNS-"
)

// Config says what to capture and where to send it.
type Config struct {
	// ListenAddr is where the resolver listens for redirected queries, e.g.
	// 127.0.0.1:15053 for host processes or the node-local 169.254.20.53:53.
	// Nameserver i of Nameservers is sent to port ListenAddr.Port()+i, other
	// destinations (CaptureAll) to port +len(Nameservers) (the slot scheme of
	// docs/design.md). A v6 address here is used for v6 destinations only.
	ListenAddr netip.AddrPort
	// ListenAddr6 is the redirect target for v6 destinations. Zero: [::1] with
	// ListenAddr's port when ListenAddr is 127.0.0.1/::1; otherwise v6 capture
	// needs it (Start fails for v6 nameservers without it, CaptureAll then
	// captures v4 only and logs it).
	ListenAddr6 netip.AddrPort
	// Nameservers are the captured destinations (port 53), v4 and v6.
	// Loopback nameservers are never captured (logged).
	Nameservers []netip.Addr
	// CaptureAll captures port 53 to every non-loopback destination.
	CaptureAll bool
	// ProxyUIDs/ProxyGIDs: sockets of these owners are never captured and their
	// flows stay out of our zone.
	ProxyUIDs []uint32
	ProxyGIDs []uint32
	// UpstreamMark is the SO_MARK of the resolver's own upstream sockets: never
	// captured, kept out of our zone. 0: DefaultUpstreamMark.
	UpstreamMark uint32
	// Zone is the conntrack zone of captured flows (both directions). 0: DefaultZone.
	Zone uint16
	// Backend is "legacy", "nft", or "" to detect (DetectBackend).
	Backend string
	// Netns is the path of the network namespace to program (e.g.
	// /var/run/netns/x). "": the namespace of the calling thread at Start.
	Netns string
	// CheckInterval is how often Run checks the rules. 0: DefaultCheckInterval.
	CheckInterval time.Duration
	Logger        *slog.Logger
}

// family is one IP family's view of the configuration.
type family struct {
	v6      bool
	listen  netip.AddrPort // redirect target; invalid: nothing of this family is captured
	servers []slotServer   // captured nameservers of this family
	all     bool           // capture-all for this family
	allPort uint16         // slot port of capture-all
	minPort uint16         // lowest and highest slot port of this family
	maxPort uint16
}

type slotServer struct {
	addr netip.Addr
	port uint16
}

func (f family) captures() bool { return f.listen.IsValid() && (len(f.servers) > 0 || f.all) }

// podCapture says whether traffic arriving from other namespaces (pods) is
// captured too: only when the target is reachable from outside, i.e. not loopback
// (DNAT to 127.0.0.1 from PREROUTING would need route_localnet).
func (f family) podCapture() bool { return f.captures() && !f.listen.Addr().IsLoopback() }

func (f family) name() string {
	if f.v6 {
		return "ip6"
	}
	return "ip4"
}

// normalized is a validated Config with the defaults filled in.
type normalized struct {
	Config
	fams     [2]family // [0] v4, [1] v6
	warnings []string
}

func normalize(cfg Config) (*normalized, error) {
	n := &normalized{Config: cfg}
	if err := n.setDefaults(); err != nil {
		return nil, err
	}
	if !cfg.ListenAddr.IsValid() && cfg.ListenAddr6.IsValid() {
		cfg.ListenAddr = cfg.ListenAddr6 // v6-only listen
	}
	if !cfg.ListenAddr.IsValid() || cfg.ListenAddr.Port() == 0 {
		return nil, fmt.Errorf("listen address %v: need an address with a port", cfg.ListenAddr)
	}
	plan, err := captureplan.New(cfg.Nameservers, cfg.CaptureAll)
	if err != nil {
		return nil, err
	}
	listen4, listen6, err := listenAddrs(cfg.ListenAddr, cfg.ListenAddr6)
	if err != nil {
		return nil, err
	}
	n.fams[0] = family{listen: listen4}
	n.fams[1] = family{v6: true, listen: listen6}
	if err := n.addServers(plan, cfg.ListenAddr); err != nil {
		return nil, err
	}
	if err := n.setSlotRanges(plan); err != nil {
		return nil, err
	}
	n.ProxyUIDs = slices.Compact(slices.Sorted(slices.Values(cfg.ProxyUIDs)))
	n.ProxyGIDs = slices.Compact(slices.Sorted(slices.Values(cfg.ProxyGIDs)))
	if !n.fams[0].captures() && !n.fams[1].captures() {
		return nil, errors.New("nothing to capture: every nameserver is loopback or has no listen address of its family")
	}
	if cfg.Netns != "" {
		if _, err := os.Stat(cfg.Netns); err != nil {
			return nil, fmt.Errorf("network namespace: %w", err)
		}
	}
	return n, nil
}

// setDefaults fills in the defaults and checks the backend.
func (n *normalized) setDefaults() error {
	if n.Logger == nil {
		n.Logger = slog.New(slog.DiscardHandler)
	}
	if n.UpstreamMark == 0 {
		n.UpstreamMark = DefaultUpstreamMark
	}
	if n.Zone == 0 {
		n.Zone = DefaultZone
	}
	if n.CheckInterval <= 0 {
		n.CheckInterval = DefaultCheckInterval
	}
	switch n.Backend {
	case "", BackendLegacy, BackendNFT:
		return nil
	}
	return fmt.Errorf("iptables backend %q: want %q, %q or empty (detect)", n.Backend, BackendLegacy, BackendNFT)
}

// listenAddrs is the redirect target of each family: listen for its own
// family, listen6 for v6 when given; a loopback listen address covers the
// other family's loopback too.
func listenAddrs(listen, listen6 netip.AddrPort) (v4, v6 netip.AddrPort, err error) {
	v6 = listen6
	la := listen.Addr().Unmap()
	if la.Is4() {
		v4 = netip.AddrPortFrom(la, listen.Port())
		if !v6.IsValid() && la.IsLoopback() {
			v6 = netip.AddrPortFrom(netip.IPv6Loopback(), listen.Port())
		}
	} else {
		if !v6.IsValid() {
			v6 = listen
		}
		if la.IsLoopback() {
			v4 = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), listen.Port())
		}
	}
	if v6.IsValid() && (!v6.Addr().Is6() || v6.Addr().Is4In6() || v6.Port() == 0) {
		return v4, v6, fmt.Errorf("v6 listen address %v: need a v6 address with a port", v6)
	}
	return v4, v6, nil
}

// addServers puts each nameserver of the plan into its family with its
// slot port (slot i: the family's listen port + i). Loopback nameservers
// keep their slot but are not captured (a warning).
func (n *normalized) addServers(plan captureplan.Plan, listen netip.AddrPort) error {
	for i, ns := range plan.Nameservers() {
		fam := &n.fams[0]
		base := listen.Port()
		if ns.Is6() {
			fam = &n.fams[1]
			if fam.listen.IsValid() {
				base = fam.listen.Port()
			}
		}
		port := int(base) + i
		if port > 65535 {
			return fmt.Errorf("nameserver %d (%v): slot port %d out of range", i, ns, port)
		}
		switch {
		case ns.IsLoopback():
			n.warnings = append(n.warnings, fmt.Sprintf("nameserver %v is a loopback address: not captured", ns))
			continue
		case fam.listen.IsValid() && ns == fam.listen.Addr():
			return fmt.Errorf("nameserver %v is the listen address itself", ns)
		case !fam.listen.IsValid():
			return fmt.Errorf("nameserver %v: no listen address of its family (listen address %v is not loopback; set ListenAddr6 for v6)", ns, listen)
		}
		fam.servers = append(fam.servers, slotServer{addr: ns, port: uint16(port)})
	}
	return nil
}

// setSlotRanges sets each family's capture-all port (the plan's first
// capture-all slot) and its range of slot ports.
func (n *normalized) setSlotRanges(plan captureplan.Plan) error {
	for i := range n.fams {
		f := &n.fams[i]
		if !f.listen.IsValid() {
			if plan.CaptureAll() {
				n.warnings = append(n.warnings, fmt.Sprintf("capture-all: no %s listen address, %s port-53 traffic is not captured", f.name(), f.name()))
			}
			continue
		}
		p := int(f.listen.Port()) + plan.AllSlot()
		if plan.CaptureAll() {
			if p > 65535 {
				return fmt.Errorf("capture-all slot port %d out of range", p)
			}
			f.all, f.allPort = true, uint16(p)
		}
		f.minPort, f.maxPort = f.listen.Port(), f.listen.Port()
		for _, s := range f.servers {
			f.maxPort = max(f.maxPort, s.port)
		}
		if f.all {
			f.maxPort = max(f.maxPort, f.allPort)
		}
	}
	return nil
}
