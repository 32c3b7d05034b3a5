package redirect

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/captureplan"
)

// Config says where the datapath attaches and what it captures.
type Config struct {
	Cgroup          string         // cgroup v2 directory to attach to
	PinDir          string         // directory on a bpffs for our pins (links/, maps/); created
	Target4         netip.AddrPort // resolver v4 address; port = slot 0 port; zero value = no v4 target
	Target6         netip.AddrPort // resolver v6 address (optional); same port as Target4 when both are set
	Nameservers     []netip.Addr   // captured nameservers; slot i → port Target.Port()+i
	CaptureAll      bool           // capture every port-53 destination (MAX_ALL_SLOTS more slots)
	CaptureLoopback bool           // also capture loopback destinations (127.0.0.0/8, ::1)
	ProxyUIDs       []uint32       // UIDs whose sockets are never captured
	UpstreamMark    uint32         // SO_MARK of the resolver's own upstream sockets; must be non-zero
	StallAfter      time.Duration  // 0: DefaultStallAfter
	// Attribution makes the programs record who sends each redirected query
	// (see Flows); without it the attribute program returns at once.
	Attribution bool
	// EgressGrants caps the egress grants map (its max_entries); 0:
	// DefaultEgressGrants. A pinned grants map of another size is replaced.
	EgressGrants int
	// Unordered attaches in attach order, as on a kernel without ordered
	// cgroup programs (a test switch; also UnorderedEnv). Otherwise ours are
	// put in front of other programs on the hooks where the kernel can.
	Unordered bool
	// Detach makes Close detach the programs and remove every pin. Without it
	// they stay attached and pinned for the next agent (inert meanwhile).
	Detach bool
	Logger *slog.Logger // nil: discard
}

// settings is a validated Config in the form the maps take.
type settings struct {
	cfg         Config
	basePort    uint16
	numSlots    uint16
	allSlot     uint16
	numAll      uint16
	flags       uint32
	nameservers []netip.Addr // unmapped, deduplicated, in slot order
}

// SlotPorts returns the ports the resolver must listen on (UDP and TCP, on every
// target address): the capture plan's slot ports from the target port (base+i
// for nameserver i, plus captureplan.CaptureAllSlots more with CaptureAll, one
// per distinct other destination a socket queries). It returns nil when no
// target is configured or the nameservers are not a valid plan.
func SlotPorts(cfg Config) []uint16 {
	base := basePort(cfg)
	plan, err := captureplan.New(cfg.Nameservers, cfg.CaptureAll)
	if base == 0 || err != nil {
		return nil
	}
	return plan.Ports(base)
}

func basePort(cfg Config) uint16 {
	if cfg.Target4.IsValid() {
		return cfg.Target4.Port()
	}
	if cfg.Target6.IsValid() {
		return cfg.Target6.Port()
	}
	return 0
}

// validate checks everything that can be checked without touching the kernel.
func validate(cfg Config) (*settings, error) {
	s := &settings{cfg: cfg}
	if cfg.Cgroup == "" {
		return nil, errors.New("no cgroup directory given")
	}
	if cfg.PinDir == "" {
		return nil, errors.New("no pin directory given")
	}
	if !cfg.Target4.IsValid() && !cfg.Target6.IsValid() {
		return nil, errors.New("no resolver target address: set an IPv4 and/or IPv6 target")
	}
	if err := s.setTargets(cfg); err != nil {
		return nil, err
	}
	if cfg.UpstreamMark == 0 {
		return nil, errors.New("upstream mark must be non-zero (it tells the resolver's own upstream sockets apart)")
	}
	plan, err := captureplan.New(cfg.Nameservers, cfg.CaptureAll)
	if err != nil {
		return nil, err
	}
	if cfg.StallAfter < 0 {
		return nil, fmt.Errorf("stall timeout %v is negative", cfg.StallAfter)
	}
	if s.cfg.StallAfter == 0 {
		s.cfg.StallAfter = DefaultStallAfter
	}
	for _, a := range plan.Nameservers() {
		for _, t := range []netip.AddrPort{s.cfg.Target4, cfg.Target6} {
			if t.IsValid() && t.Addr() == a {
				return nil, fmt.Errorf("nameserver %s is the resolver's own address", a)
			}
		}
	}
	s.nameservers = plan.Nameservers()
	if len(s.nameservers) > maxNameservers {
		return nil, fmt.Errorf("%d nameservers given, at most %d are supported", len(s.nameservers), maxNameservers)
	}
	if cfg.EgressGrants < 0 {
		return nil, fmt.Errorf("egress grant cap %d is negative", cfg.EgressGrants)
	}
	if len(cfg.ProxyUIDs) > maxProxyUIDs {
		return nil, fmt.Errorf("%d proxy UIDs given, at most %d are supported", len(cfg.ProxyUIDs), maxProxyUIDs)
	}
	s.allSlot = uint16(plan.AllSlot())
	if cfg.CaptureAll {
		s.flags |= flagCaptureAll
		s.numAll = uint16(plan.AllSlots())
	}
	if cfg.CaptureLoopback {
		s.flags |= flagCaptureLoopback
	}
	if cfg.Attribution {
		s.flags |= flagAttribution
	}
	s.basePort = basePort(s.cfg)
	if err := plan.CheckPorts(s.basePort); err != nil {
		return nil, err
	}
	slots := plan.Slots()
	s.numSlots = uint16(slots)
	s.cfg.Nameservers = s.nameservers
	return s, nil
}

// setTargets checks the resolver's target addresses and sets their flags.
func (s *settings) setTargets(cfg Config) error {
	if cfg.Target4.IsValid() {
		a := cfg.Target4.Addr().Unmap()
		if !a.Is4() || a.IsUnspecified() {
			return fmt.Errorf("IPv4 target %s is not a usable IPv4 address", cfg.Target4)
		}
		if cfg.Target4.Port() == 0 {
			return fmt.Errorf("IPv4 target %s has no port", cfg.Target4)
		}
		s.flags |= flagTarget4
		if a.IsLoopback() {
			s.flags |= flagTarget4Loopback
		}
		s.cfg.Target4 = netip.AddrPortFrom(a, cfg.Target4.Port())
	}
	if cfg.Target6.IsValid() {
		a := cfg.Target6.Addr()
		if !a.Is6() || a.Is4In6() || a.IsUnspecified() || a.Zone() != "" {
			return fmt.Errorf("IPv6 target %s is not a usable IPv6 address (no v4-mapped, no zone)", cfg.Target6)
		}
		if cfg.Target6.Port() == 0 {
			return fmt.Errorf("IPv6 target %s has no port", cfg.Target6)
		}
		if cfg.Target4.IsValid() && cfg.Target6.Port() != cfg.Target4.Port() {
			return fmt.Errorf("IPv4 target %s and IPv6 target %s must use the same port", cfg.Target4, cfg.Target6)
		}
		s.flags |= flagTarget6
		if a.IsLoopback() {
			s.flags |= flagTarget6Loopback
		}
	}
	return nil
}
