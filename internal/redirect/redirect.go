// Package redirect is meshdns-ebpf's eBPF datapath: it loads the cgroup sock_addr
// programs of bpf/redirect.c (compiled by bpf2go, committed), writes their
// configuration into maps, attaches them to a cgroup v2 directory with bpf_links
// (or adopts the links a previous agent left pinned, replacing their programs
// atomically), registers the resolver's listening sockets that switch capture on,
// feeds the resolver's progress to the programs, and reads their counters back
// for the CLI and for metrics.
//
// The programs redirect port-53 traffic to captured nameservers to the resolver
// (nameserver i goes to the resolver's port base+i, see [SlotPorts]) and restore
// the original nameserver as reply source and peer. They redirect only to a slot
// whose resolver socket is registered ([Datapath.Serve]); the kernel drops a
// socket from that set when it closes, so a dead resolver is bypassed at once. A
// resolver that stops dequeuing is bypassed after [DefaultStallAfter]
// (progress, see [Datapath.Dequeued]).
//
// Lifecycle: [New] validates, [Datapath.Start] acquires, [Datapath.Close]
// releases. A clean Close leaves the programs attached and pinned (inert, since
// no resolver socket is registered) for the next agent to adopt, unless
// Config.Detach.
package redirect

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/meshdns/meshdns-ebpf/internal/captureplan"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
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

// Datapath is the loaded, configured and attached set of programs.
type Datapath struct {
	log    *slog.Logger
	set    *settings
	pinDir string

	mu       sync.Mutex
	started  bool
	closed   bool
	handoff  bool
	discard  bool
	netns    uint64 // cookie of Start's network namespace
	objs     redirectObjects
	links    []attached
	progress *progress
	clock    *watchClock            // nil where the kernel has no BPF timers
	dequeued atomic.Pointer[uint64] // progress.dequeued while mapped
	flows    *Flows                 // the flows map, memory-mapped
	served   []uint32               // resolver_socks keys we registered
	ownPins  []string               // map pins Start made (not reused)
	// madePinDir: the pin directory did not exist before Start.
	madePinDir bool
	order      Ordering                          // how ours are placed among other programs (order.go)
	backends   map[redirectNsKey]redirectBackend // SetBackends' (backends.go)
	cgroups    *cgroup2.Namer
	probe      *net.UDPConn // the watchdog's, opened in Start's network namespace
	stopWD     context.CancelFunc
	wdDone     chan struct{}
}

type attached struct {
	hook    hook
	link    link.Link
	id      link.ID
	pin     string
	adopted bool // the link was pinned by a previous agent; we replaced its program
}

// ProgramInfo describes one attached program.
type ProgramInfo struct {
	Hook      string `json:"hook"`
	ProgramID uint32 `json:"program_id"`
	LinkID    uint32 `json:"link_id"`
	Cgroup    string `json:"cgroup"`
}

// New validates cfg. It touches nothing in the kernel.
func New(cfg Config) (*Datapath, error) {
	set, err := validate(cfg)
	if err != nil {
		return nil, fmt.Errorf("invalid datapath config: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	order := Ordering{Supported: true}
	if cfg.Unordered || os.Getenv(UnorderedEnv) == "1" {
		order = Ordering{Reason: "ordered attach switched off"}
	}
	return &Datapath{log: log, set: set, pinDir: cfg.PinDir, order: order, cgroups: cgroup2.NewNamer()}, nil
}

// Start loads the programs, writes their configuration, and attaches every
// program to Config.Cgroup with a bpf_link pinned under Config.PinDir
// (links/<program>, maps/<map>). Links a previous agent left pinned there (a
// restart, an upgrade, a crash) are adopted: their programs are replaced in
// place, so capture has no gap, and the maps whose layout is unchanged are kept
// (the per-socket state of sockets redirected earlier, the registered resolver
// sockets of a running predecessor, the counters). Nothing is redirected until a
// resolver socket is registered with Serve. On error, what this Start attached
// or pinned is removed again; adopted links are left as they were.
func (d *Datapath) Start(ctx context.Context) (err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.started || d.closed {
		return errors.New("datapath already started or closed")
	}
	d.started = true
	netnsCookie, err := d.checkStart()
	if err != nil {
		return err
	}
	spec, err := loadRedirect()
	if err != nil {
		return fmt.Errorf("load embedded eBPF object: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	reused := reusableMaps(d.pinDir, spec, d.log)
	defer func() {
		for _, m := range reused {
			m.Close() // the collection holds its own clones
		}
	}()
	if _, statErr := os.Stat(d.pinDir); errors.Is(statErr, os.ErrNotExist) {
		d.madePinDir = true
	}
	defer func() {
		if err != nil {
			// One release path, Close's: what this Start made goes again.
			_, _ = d.releaseLocked(true)
		}
	}()
	if err := d.load(spec, reused, netnsCookie); err != nil {
		return err
	}
	if d.ownPins, err = d.pinMaps(reused); err != nil {
		return err
	}
	if err := d.attach(); err != nil {
		return err
	}
	if err := removeForeignPins(d.pinDir); err != nil {
		d.log.Warn("remove pins of an older version", "err", err)
	}
	if err := d.startWatchdog(); err != nil {
		return err
	}
	d.logStarted(reused)
	return nil
}

// checkStart checks what Start needs before it loads anything: the cgroup,
// the pin directory, this network namespace's cookie (for a loopback target)
// and the memlock rlimit. It returns the cookie.
func (d *Datapath) checkStart() (uint64, error) {
	cfg := d.set.cfg
	if err := cgroup2.CheckDir(cfg.Cgroup); err != nil {
		return 0, err
	}
	if err := checkPinDir(cfg.PinDir); err != nil {
		return 0, err
	}
	netnsCookie, err := ownNetnsCookie()
	if err != nil && d.set.flags&(flagTarget4Loopback|flagTarget6Loopback) != 0 {
		return 0, fmt.Errorf("a loopback target needs this network namespace's cookie: %w", err)
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return 0, fmt.Errorf("remove memlock rlimit: %w", err)
	}
	return netnsCookie, nil
}

// load loads the programs and maps (reusing the compatible pinned maps),
// writes the configuration and maps the shared memory (progress, flows).
func (d *Datapath) load(spec *ebpf.CollectionSpec, reused map[string]*ebpf.Map, netnsCookie uint64) (err error) {
	if err := spec.LoadAndAssign(&d.objs, &ebpf.CollectionOptions{MapReplacements: reused}); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("load eBPF programs: the verifier rejected them: %+v", ve)
		}
		return fmt.Errorf("load eBPF programs: %w%s", err, permissionHint(err))
	}
	d.netns = netnsCookie
	if err := d.writeConfig(netnsCookie); err != nil {
		return err
	}
	if d.progress, err = mapProgress(d.objs.Progress); err != nil {
		return err
	}
	d.dequeued.Store(d.progress.field(unsafe.Offsetof(redirectMeshdnsProgress{}.Dequeued)))
	if d.flows, err = mapFlows(d.objs.Flows); err != nil {
		return err
	}
	d.startClock()
	return nil
}

// startWatchdog opens the resolver liveness probe socket (in Start's network
// namespace) and starts the watchdog.
func (d *Datapath) startWatchdog() (err error) {
	network := "udp4"
	if !d.set.cfg.Target4.IsValid() {
		network = "udp6"
	}
	if d.probe, err = net.ListenUDP(network, nil); err != nil {
		return fmt.Errorf("open the resolver liveness probe socket: %w", err)
	}
	wctx, cancel := context.WithCancel(context.Background())
	d.stopWD = cancel
	d.wdDone = make(chan struct{})
	go d.watchdog(wctx)
	return nil
}

func (d *Datapath) logStarted(reused map[string]*ebpf.Map) {
	adopted := 0
	for _, a := range d.links {
		if a.adopted {
			adopted++
		}
	}
	cfg := d.set.cfg
	d.log.Info("eBPF datapath attached", "cgroup", cfg.Cgroup, "pin_dir", cfg.PinDir,
		"target4", cfg.Target4, "target6", cfg.Target6, "nameservers", d.set.nameservers,
		"capture_all", cfg.CaptureAll, "slot_ports", SlotPorts(cfg),
		"adopted_links", adopted, "kept_maps", sortedNames(reused), "watch_clock", d.clock != nil)
	d.logCoexistence(ourIDs(d.programsLocked()))
}

// startClock starts the watch clock where the kernel can run it; elsewhere
// stalls are timed by the programs alone (see watchclock.go).
func (d *Datapath) startClock() {
	c, err := startWatchClock(d.objs.Config, d.objs.Progress)
	if err != nil {
		d.log.Info("no watch clock: a stalled resolver is timed from the first query it leaves unread", "reason", err)
		return
	}
	d.clock = c
}

func permissionHint(err error) string {
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		return " (loading these programs needs CAP_BPF and CAP_NET_ADMIN)"
	}
	return ""
}

// reusableMaps opens the maps pinned under pinDir that are compatible with spec
// (same type, key, value, size, flags); others are left out and replaced by
// fresh ones.
func reusableMaps(pinDir string, spec *ebpf.CollectionSpec, log *slog.Logger) map[string]*ebpf.Map {
	out := map[string]*ebpf.Map{}
	for name, ms := range spec.Maps {
		if strings.HasPrefix(name, ".") {
			continue // internal maps (.bss): never pinned
		}
		p := filepath.Join(pinDir, mapsDir, name)
		m, err := ebpf.LoadPinnedMap(p, nil)
		if err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				log.Warn("cannot reuse pinned map, starting afresh", "map", p, "err", err)
			}
			continue
		}
		if err := ms.Compatible(m); err != nil {
			log.Warn("pinned map is incompatible with this version, starting afresh", "map", p, "err", err)
			m.Close()
			continue
		}
		out[name] = m
	}
	return out
}

func sortedNames(m map[string]*ebpf.Map) []string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func addrWords(a netip.Addr) [4]uint32 {
	b := a.As16()
	var w [4]uint32
	for i := range w {
		w[i] = binary.NativeEndian.Uint32(b[4*i:])
	}
	return w
}

// writeConfig writes the configuration maps. Reused maps may hold a previous
// agent's entries: nameservers and proxy UIDs we do not have are deleted.
func (d *Datapath) writeConfig(netnsCookie uint64) error {
	s := d.set
	c := redirectMeshdnsConfig{
		BasePort:         s.basePort,
		NumSlots:         s.numSlots,
		AllSlot:          s.allSlot,
		NumAll:           s.numAll,
		Flags:            s.flags,
		UpstreamMark:     s.cfg.UpstreamMark,
		AgentNetnsCookie: netnsCookie,
		StallNs:          uint64(s.cfg.StallAfter),
	}
	if s.cfg.Target4.IsValid() {
		c.Target4 = addrWords(s.cfg.Target4.Addr())[3]
	}
	if s.cfg.Target6.IsValid() {
		c.Target6 = addrWords(s.cfg.Target6.Addr())
	}
	want := map[redirectNsKey]uint32{}
	for i, ns := range s.nameservers {
		want[redirectNsKey{Addr: addrWords(ns)}] = uint32(i)
	}
	var (
		key  redirectNsKey
		slot uint32
		gone []redirectNsKey
	)
	it := d.objs.Nameservers.Iterate()
	for it.Next(&key, &slot) {
		if _, ok := want[key]; !ok {
			gone = append(gone, key)
		}
	}
	for k, v := range want {
		if err := d.objs.Nameservers.Put(&k, v); err != nil {
			return fmt.Errorf("write nameserver to map: %w", err)
		}
	}
	// The config (slot count) before the deletes, so that no program sees a
	// nameserver with a slot past num_slots.
	if err := d.objs.Config.Put(uint32(0), &c); err != nil {
		return fmt.Errorf("write config map: %w", err)
	}
	for _, k := range gone {
		if err := d.objs.Nameservers.Delete(&k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("delete stale nameserver from map: %w", err)
		}
	}
	wantUID := map[uint32]bool{}
	for _, uid := range s.cfg.ProxyUIDs {
		wantUID[uid] = true
		if err := d.objs.ProxyUids.Put(uid, uint32(1)); err != nil {
			return fmt.Errorf("write proxy uid %d to map: %w", uid, err)
		}
	}
	var uid, one uint32
	var goneUIDs []uint32
	uit := d.objs.ProxyUids.Iterate()
	for uit.Next(&uid, &one) {
		if !wantUID[uid] {
			goneUIDs = append(goneUIDs, uid)
		}
	}
	for _, u := range goneUIDs {
		_ = d.objs.ProxyUids.Delete(u)
	}
	return d.writeBackends()
}

func (d *Datapath) mapsByName() map[string]*ebpf.Map {
	m := d.objs.redirectMaps
	return map[string]*ebpf.Map{
		redirectMapBackends:      m.Backends,
		redirectMapCgroupStats:   m.CgroupStats,
		redirectMapConfig:        m.Config,
		redirectMapFlows:         m.Flows,
		redirectMapNameservers:   m.Nameservers,
		redirectMapProgress:      m.Progress,
		redirectMapProxyUids:     m.ProxyUids,
		redirectMapResolverSocks: m.ResolverSocks,
		redirectMapSockState:     m.SockState,
		redirectMapStats:         m.Stats,
	}
}

func (d *Datapath) programsByName() map[string]*ebpf.Program {
	p := d.objs.redirectPrograms
	return map[string]*ebpf.Program{
		redirectProgConnect4:     p.Connect4,
		redirectProgConnect6:     p.Connect6,
		redirectProgSendmsg4:     p.Sendmsg4,
		redirectProgSendmsg6:     p.Sendmsg6,
		redirectProgRecvmsg4:     p.Recvmsg4,
		redirectProgRecvmsg6:     p.Recvmsg6,
		redirectProgGetpeername4: p.Getpeername4,
		redirectProgGetpeername6: p.Getpeername6,
		redirectProgAttribute:    p.Attribute,
		redirectProgSockRelease:  p.SockRelease,
	}
}

// pinMaps pins the maps that are not reused (replacing an incompatible pin of a
// previous version) and returns the pins it created.
func (d *Datapath) pinMaps(reused map[string]*ebpf.Map) ([]string, error) {
	dir := filepath.Join(d.pinDir, mapsDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create %s: %w", dir, err)
	}
	var created []string
	for name, m := range d.mapsByName() {
		if _, ok := reused[name]; ok {
			continue
		}
		p := filepath.Join(dir, name)
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return created, fmt.Errorf("replace pin %s: %w", p, err)
		}
		if err := m.Pin(p); err != nil {
			return created, fmt.Errorf("pin map %s at %s: %w", name, p, err)
		}
		created = append(created, p)
	}
	return created, nil
}

// attach adopts each pinned link that is attached to our cgroup with the hook's
// attach type (replacing its program atomically), and attaches and pins a new
// link for the others.
func (d *Datapath) attach() error {
	cgPath := d.set.cfg.Cgroup
	cg, err := os.Open(cgPath)
	if err != nil {
		return fmt.Errorf("open cgroup %s: %w", cgPath, err)
	}
	defer cg.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(cg.Fd()), &st); err != nil {
		return fmt.Errorf("stat cgroup %s: %w", cgPath, err)
	}
	cgID := st.Ino // a cgroup's id is the inode of its directory
	dir := filepath.Join(d.pinDir, linksDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	progs := d.programsByName()
	for _, h := range hooks {
		p := filepath.Join(dir, h.name)
		prog := progs[h.name]
		if l, ok := d.adoptable(p, h, cgID); ok {
			// A link behind another program (attached on an older kernel, or
			// before another datapath attached in front of it) is replaced
			// by one in front, where the kernel can; else its program is.
			var ahead bool
			if d.order.Supported && ordersHook(h) {
				var oldProg ebpf.ProgramID
				if info, err := l.Info(); err == nil {
					oldProg = info.Program
				}
				behind, err := foreignBefore(cg, h, map[ebpf.ProgramID]bool{oldProg: true, programID(prog): true})
				if err != nil {
					d.log.Warn("cannot tell whether the adopted link runs first", "hook", h.name, "err", err)
				}
				if behind {
					nl, err := d.relink(cg, prog, h, l, p)
					if err != nil {
						l.Close()
						return err
					}
					l, ahead = nl, true
					d.log.Info("adopted link ran behind another program: replaced by one in front", "hook", h.name)
				}
			}
			if !ahead {
				if err := l.Update(prog); err != nil {
					l.Close()
					return fmt.Errorf("replace the program of the pinned link %s: %w", p, err)
				}
			}
			// A relinked link counts as adopted too: a failed start leaves it
			// pinned, as it found the link it replaced, for the predecessor.
			a := attached{hook: h, link: l, pin: p, adopted: true}
			if info, err := l.Info(); err == nil {
				a.id = info.ID
			}
			d.links = append(d.links, a)
			continue
		}
		// A pin that is not ours to adopt (another cgroup, another hook): gone.
		if _, err := os.Stat(p); err == nil {
			if err := detachPinnedLink(p); err != nil {
				return err
			}
		}
		l, err := d.attachNew(cg, prog, h)
		if err != nil {
			hint := permissionHint(err)
			if errors.Is(err, unix.EPERM) {
				hint = " (another program may be attached to this cgroup exclusively, without BPF_F_ALLOW_MULTI; or CAP_NET_ADMIN is missing)"
			}
			return fmt.Errorf("attach %s (%s) to cgroup %s: %w%s", h.section, h.attachName, cgPath, err, hint)
		}
		a := attached{hook: h, link: l, pin: p}
		if info, err := l.Info(); err == nil {
			a.id = info.ID
		}
		d.links = append(d.links, a)
		if err := l.Pin(p); err != nil {
			return fmt.Errorf("pin link of %s at %s: %w", h.section, p, err)
		}
	}
	return nil
}

// adoptable opens the link pinned at p when it attaches h's attach type to the
// cgroup cgID.
func (d *Datapath) adoptable(p string, h hook, cgID uint64) (link.Link, bool) {
	l, err := link.LoadPinnedLink(p, nil)
	if err != nil {
		return nil, false
	}
	info, err := l.Info()
	if err != nil {
		l.Close()
		return nil, false
	}
	cg := info.Cgroup()
	if cg == nil || cg.CgroupId != cgID || ebpf.AttachType(cg.AttachType) != h.attach {
		l.Close()
		return nil, false
	}
	return l, true
}

// removeForeignPins detaches and removes pins under pinDir that are not ours:
// links and maps of an older version with other programs or maps.
func removeForeignPins(pinDir string) error {
	ours := map[string]bool{}
	for _, h := range hooks {
		ours[filepath.Join(pinDir, linksDir, h.name)] = true
	}
	for _, name := range []string{redirectMapBackends, redirectMapCgroupStats, redirectMapConfig, redirectMapFlows, redirectMapNameservers, redirectMapProgress,
		redirectMapProxyUids, redirectMapResolverSocks, redirectMapSockState, redirectMapStats} {
		ours[filepath.Join(pinDir, mapsDir, name)] = true
	}
	var errs []error
	for _, sub := range []string{linksDir, mapsDir} {
		entries, err := os.ReadDir(filepath.Join(pinDir, sub))
		if err != nil {
			continue
		}
		for _, e := range entries {
			p := filepath.Join(pinDir, sub, e.Name())
			if ours[p] || e.IsDir() {
				continue
			}
			if sub == linksDir {
				errs = append(errs, detachPinnedLink(p))
			} else if err := os.Remove(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// removeEmptyPinDirs removes links/, maps/ and the pin directory itself when they
// are empty.
func removeEmptyPinDirs(pinDir string) []error {
	var errs []error
	for _, p := range []string{filepath.Join(pinDir, linksDir), filepath.Join(pinDir, mapsDir), pinDir} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) && !errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) {
			errs = append(errs, fmt.Errorf("remove %s: %w", p, err))
		}
	}
	return errs
}

// Handoff tells the datapath that a successor adopted it: Close then releases
// only this process's file descriptors, leaving the registered resolver sockets
// (now shared with the successor), the links and the pins alone.
func (d *Datapath) Handoff() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.handoff = true
}

// Discard makes Close remove what Start attached and pinned itself (for an
// agent whose start failed: it leaves nothing behind), while links it adopted
// stay pinned as they were found.
func (d *Datapath) Discard() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.discard = true
}

// DetachOnClose makes Close detach the programs and remove every pin, as
// Config.Detach does (an uninstall decided while the datapath runs). A
// handoff still wins: the successor's links stay.
func (d *Datapath) DetachOnClose() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.set.cfg.Detach = true
}

// Reassert makes this datapath current again after a successor that had
// started to take it over failed: this datapath's programs go back into the
// pinned links and its configuration into the maps. The caller registers its
// resolver sockets again (Serve).
func (d *Datapath) Reassert() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || d.objs.Config == nil {
		return errors.New("datapath is not started or closed")
	}
	var errs []error
	progs := d.programsByName()
	for i, a := range d.links {
		err := a.link.Update(progs[a.hook.name])
		if err != nil {
			// The successor may have replaced our link by one in front of
			// another program (relink): the program goes into the pinned one.
			var l link.Link
			if l, err = link.LoadPinnedLink(a.pin, nil); err == nil {
				if err = l.Update(progs[a.hook.name]); err == nil {
					a.link.Close()
					d.links[i].link = l
					if info, ierr := l.Info(); ierr == nil {
						d.links[i].id = info.ID
					}
				} else {
					l.Close()
				}
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("put the program of %s back: %w", a.hook.name, err))
		}
	}
	errs = append(errs, d.writeConfig(d.netns))
	return errors.Join(errs...)
}

// Close stops the watchdog and unregisters the resolver sockets registered
// with Serve (capture stops), unless Handoff was called. With Config.Detach (and
// no handoff) it then detaches every program and removes every pin (and the
// pin directory when it is then empty); otherwise links and maps stay pinned,
// and attached but inert, for the next agent to adopt. It closes this process's
// file descriptors in every case. Close is idempotent and safe after a failed
// or missing Start.
func (d *Datapath) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	stop, done := d.stopWD, d.wdDone
	d.mu.Unlock()
	if stop != nil {
		stop()
		<-done
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.started || d.objs.Config == nil {
		return nil
	}
	detached, err := d.releaseLocked(false)
	if err != nil {
		return err
	}
	switch {
	case d.handoff:
		d.log.Info("eBPF datapath handed over to the successor")
	case detached:
		d.log.Info("eBPF datapath detached", "cgroup", d.set.cfg.Cgroup)
	default:
		d.log.Info("eBPF datapath left attached and pinned (inert) for the next agent", "pin_dir", d.pinDir)
	}
	return nil
}

// releaseLocked releases what Start acquired, with d.mu held and the watchdog
// stopped: it is Close's release and Start's rollback. Unless handed off, the
// registered resolver sockets are unregistered. With Detach (and no handoff)
// every link is detached and every pin removed; with Discard only the links
// and map pins this Start made (and the pin directory when Start made it and
// it is empty), adopted links staying as they were found. Every descriptor is
// closed. A rollback (a failed Start) releases as Discard does, whatever
// Detach says. detached reports that every link was detached.
func (d *Datapath) releaseLocked(rollback bool) (detached bool, err error) {
	if d.probe != nil {
		d.probe.Close()
		d.probe = nil
	}
	var errs []error
	if !d.handoff {
		errs = append(errs, d.unserveLocked())
	}
	detach := d.set.cfg.Detach && !d.handoff && !rollback
	discard := (d.discard || rollback) && !d.handoff
	detached = detach || discard
	for _, a := range d.links {
		if detach || (discard && !a.adopted) {
			if err := a.link.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) {
				errs = append(errs, fmt.Errorf("detach %s: %w", a.hook.section, err))
			}
			if err := a.link.Unpin(); err != nil {
				errs = append(errs, fmt.Errorf("unpin link %s: %w", a.pin, err))
			}
		}
		detached = detached && (detach || !a.adopted)
		if err := a.link.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close link %s: %w", a.hook.name, err))
		}
	}
	d.links = nil
	errs = append(errs, d.removePinsLocked(detach, discard)...)
	d.dequeued.Store(nil)
	if err := d.clock.close(); err != nil {
		errs = append(errs, fmt.Errorf("close the watch clock: %w", err))
	}
	d.clock = nil
	if d.progress != nil {
		d.progress.close()
		d.progress = nil
	}
	d.flows.close()
	d.flows = nil
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close eBPF objects: %w", err))
	}
	d.objs = redirectObjects{}
	return detached, errors.Join(errs...)
}

// removePinsLocked removes the map pins: every one with detach, those this
// Start made with discard; then the pin directories when they are empty and
// ours to remove.
func (d *Datapath) removePinsLocked(detach, discard bool) []error {
	var errs []error
	var pins []string
	switch {
	case detach:
		for name := range d.mapsByName() {
			pins = append(pins, filepath.Join(d.pinDir, mapsDir, name))
		}
	case discard:
		pins = d.ownPins
	}
	for _, p := range pins {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("unpin map %s: %w", filepath.Base(p), err))
		}
	}
	d.ownPins = nil
	if detach || (discard && d.madePinDir) {
		errs = append(errs, removeEmptyPinDirs(d.pinDir)...)
	}
	return errs
}

// Programs lists the attached programs.
func (d *Datapath) Programs() []ProgramInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.programsLocked()
}

// programsLocked is Programs with d.mu held.
func (d *Datapath) programsLocked() []ProgramInfo {
	out := make([]ProgramInfo, 0, len(d.links))
	progs := d.programsByName()
	for _, a := range d.links {
		pi := ProgramInfo{Hook: a.hook.name, LinkID: uint32(a.id), Cgroup: d.set.cfg.Cgroup}
		if p := progs[a.hook.name]; p != nil {
			if info, err := p.Info(); err == nil {
				if id, ok := info.ID(); ok {
					pi.ProgramID = uint32(id)
				}
			}
		}
		out = append(out, pi)
	}
	return out
}
