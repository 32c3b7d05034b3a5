// Package redirect is meshdns-ebpf's eBPF datapath: it loads the cgroup sock_addr
// programs of bpf/redirect.c (compiled by bpf2go, committed), writes their
// configuration into maps, attaches them to a cgroup v2 directory with bpf_links,
// pins links and maps on a bpffs, keeps the fail-open heartbeat alive, detaches
// them again, and reads their counters back from the pins for the CLI.
//
// The programs redirect port-53 traffic to captured nameservers to the resolver
// (nameserver i goes to the resolver's port base+i, see [SlotPorts]) and restore
// the original nameserver as reply source and peer. They redirect only while the
// agent is ready and its heartbeat (written by [Datapath.Run]) is younger than HeartbeatTimeout (600 ms).
package redirect

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// Config says where the datapath attaches and what it captures.
type Config struct {
	Cgroup          string         // cgroup v2 directory to attach to
	PinDir          string         // directory on a bpffs for our pins (links/, maps/); created
	Target4         netip.AddrPort // resolver v4 address; port = slot 0 port; zero value = no v4 target
	Target6         netip.AddrPort // resolver v6 address (optional); same port as Target4 when both are set
	Nameservers     []netip.Addr   // captured nameservers; slot i → port Target.Port()+i
	CaptureAll      bool           // capture every port-53 destination (slot len(Nameservers))
	CaptureLoopback bool           // also capture loopback destinations (127.0.0.0/8, ::1)
	ProxyUIDs       []uint32       // UIDs whose sockets are never captured
	UpstreamMark    uint32         // SO_MARK of the resolver's own upstream sockets; must be non-zero
	Logger          *slog.Logger   // nil: discard
}

// HeartbeatInterval is how often [Datapath.Run] refreshes the heartbeat; the
// programs stop redirecting when it is older than [HeartbeatTimeout].
const (
	HeartbeatInterval = 100 * time.Millisecond
	HeartbeatTimeout  = time.Duration(heartbeatTimeoutNS)
)

// settings is a validated Config in the form the maps take.
type settings struct {
	cfg         Config
	basePort    uint16
	numSlots    uint16
	allSlot     uint16
	flags       uint32
	nameservers []netip.Addr // unmapped, deduplicated, in slot order
}

// SlotPorts returns the ports the resolver must listen on (UDP and TCP, on every
// target address): base+i for nameserver i, plus base+len(Nameservers) with
// CaptureAll. It returns nil when no target is configured.
func SlotPorts(cfg Config) []uint16 {
	base := basePort(cfg)
	if base == 0 {
		return nil
	}
	n := len(cfg.Nameservers)
	if cfg.CaptureAll {
		n++
	}
	ports := make([]uint16, 0, n)
	for i := 0; i < n; i++ {
		if int(base)+i > 65535 {
			break
		}
		ports = append(ports, base+uint16(i))
	}
	return ports
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
	if cfg.Target4.IsValid() {
		a := cfg.Target4.Addr().Unmap()
		if !a.Is4() || a.IsUnspecified() {
			return nil, fmt.Errorf("IPv4 target %s is not a usable IPv4 address", cfg.Target4)
		}
		if cfg.Target4.Port() == 0 {
			return nil, fmt.Errorf("IPv4 target %s has no port", cfg.Target4)
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
			return nil, fmt.Errorf("IPv6 target %s is not a usable IPv6 address (no v4-mapped, no zone)", cfg.Target6)
		}
		if cfg.Target6.Port() == 0 {
			return nil, fmt.Errorf("IPv6 target %s has no port", cfg.Target6)
		}
		if cfg.Target4.IsValid() && cfg.Target6.Port() != cfg.Target4.Port() {
			return nil, fmt.Errorf("IPv4 target %s and IPv6 target %s must use the same port", cfg.Target4, cfg.Target6)
		}
		s.flags |= flagTarget6
		if a.IsLoopback() {
			s.flags |= flagTarget6Loopback
		}
	}
	if cfg.UpstreamMark == 0 {
		return nil, errors.New("upstream mark must be non-zero (it tells the resolver's own upstream sockets apart)")
	}
	if len(cfg.Nameservers) == 0 && !cfg.CaptureAll {
		return nil, errors.New("nothing to capture: give nameservers or enable capture-all")
	}
	seen := map[netip.Addr]bool{}
	for _, ns := range cfg.Nameservers {
		a := ns.Unmap().WithZone("")
		if !a.IsValid() || a.IsUnspecified() {
			return nil, fmt.Errorf("nameserver %q is not a usable address", ns)
		}
		if seen[a] {
			return nil, fmt.Errorf("nameserver %s is listed twice", a)
		}
		seen[a] = true
		for _, t := range []netip.AddrPort{s.cfg.Target4, cfg.Target6} {
			if t.IsValid() && t.Addr() == a {
				return nil, fmt.Errorf("nameserver %s is the resolver's own address", a)
			}
		}
		s.nameservers = append(s.nameservers, a)
	}
	if len(s.nameservers) > maxNameservers {
		return nil, fmt.Errorf("%d nameservers given, at most %d are supported", len(s.nameservers), maxNameservers)
	}
	if len(cfg.ProxyUIDs) > maxProxyUIDs {
		return nil, fmt.Errorf("%d proxy UIDs given, at most %d are supported", len(cfg.ProxyUIDs), maxProxyUIDs)
	}
	slots := len(s.nameservers)
	s.allSlot = uint16(slots)
	if cfg.CaptureAll {
		s.flags |= flagCaptureAll
		slots++
	}
	if cfg.CaptureLoopback {
		s.flags |= flagCaptureLoopback
	}
	s.basePort = basePort(s.cfg)
	if int(s.basePort)+slots-1 > 65535 {
		return nil, fmt.Errorf("slot ports %d..%d run past 65535", s.basePort, int(s.basePort)+slots-1)
	}
	s.numSlots = uint16(slots)
	s.cfg.Nameservers = s.nameservers
	return s, nil
}

// Datapath is the loaded, configured and attached set of programs.
type Datapath struct {
	log    *slog.Logger
	set    *settings
	pinDir string
	objs   redirectObjects
	links  []attached

	mu            sync.Mutex
	ready         bool
	lastHeartbeat uint64 // CLOCK_MONOTONIC ns of the last state write
	closed        bool
}

type attached struct {
	hook hook
	link link.Link
	id   link.ID
	pin  string
}

// ProgramInfo describes one attached program.
type ProgramInfo struct {
	Hook      string `json:"hook"`
	ProgramID uint32 `json:"program_id"`
	LinkID    uint32 `json:"link_id"`
	Cgroup    string `json:"cgroup"`
}

// Install validates cfg, loads the programs, writes their configuration, attaches
// every program to cfg.Cgroup with a bpf_link and pins links and maps under
// cfg.PinDir (links/<program>, maps/<map>), replacing whatever a crashed or
// persisted agent left there (its per-socket state and counters are kept when
// their layout is unchanged). The datapath starts not ready: nothing is
// redirected until SetReady(true). On any error everything attached or pinned so
// far is removed again.
func Install(cfg Config) (dp *Datapath, err error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	set, err := validate(cfg)
	if err != nil {
		return nil, fmt.Errorf("invalid datapath config: %w", err)
	}
	if err := checkCgroup2Dir(cfg.Cgroup); err != nil {
		return nil, err
	}
	if err := checkPinDir(cfg.PinDir); err != nil {
		return nil, err
	}
	netnsCookie, err := ownNetnsCookie()
	if err != nil && set.flags&(flagTarget4Loopback|flagTarget6Loopback) != 0 {
		return nil, fmt.Errorf("a loopback target needs this network namespace's cookie: %w", err)
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("remove memlock rlimit: %w", err)
	}
	spec, err := loadRedirect()
	if err != nil {
		return nil, fmt.Errorf("load embedded eBPF object: %w", err)
	}
	// A previous agent's socket state and counters carry over, so sockets it
	// redirected still get their replies restored; everything else is replaced.
	reused := reusableMaps(cfg.PinDir, spec, log)
	defer func() {
		for _, m := range reused {
			m.Close() // the collection holds its own clones
		}
	}()
	if removed, err := Cleanup(cfg.PinDir); err != nil {
		return nil, fmt.Errorf("remove leftovers in %s: %w", cfg.PinDir, err)
	} else if len(removed) > 0 {
		log.Warn("replaced the pins of a previous agent", "pin_dir", cfg.PinDir, "removed", removed, "kept_maps", sortedNames(reused))
	}

	d := &Datapath{log: log, set: set, pinDir: cfg.PinDir}
	createdPinDir := false
	if _, statErr := os.Stat(cfg.PinDir); errors.Is(statErr, os.ErrNotExist) {
		createdPinDir = true
	}
	defer func() {
		if err != nil {
			d.teardown()
			if createdPinDir {
				_ = os.Remove(cfg.PinDir)
			}
		}
	}()

	if err := spec.LoadAndAssign(&d.objs, &ebpf.CollectionOptions{MapReplacements: reused}); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load eBPF programs: the verifier rejected them: %+v", ve)
		}
		return nil, fmt.Errorf("load eBPF programs: %w", err)
	}
	if err := d.writeConfig(netnsCookie); err != nil {
		return nil, err
	}
	if err := d.writeState(false); err != nil {
		return nil, err
	}
	if err := d.pinMaps(); err != nil {
		return nil, err
	}
	if err := d.attach(); err != nil {
		return nil, err
	}
	log.Info("eBPF datapath attached", "cgroup", cfg.Cgroup, "pin_dir", cfg.PinDir,
		"target4", set.cfg.Target4, "target6", set.cfg.Target6, "nameservers", set.nameservers,
		"capture_all", cfg.CaptureAll, "slot_ports", SlotPorts(set.cfg))
	return d, nil
}

// reusedMapNames are the maps whose contents survive an agent restart: the
// per-socket original destinations and the counters.
var reusedMapNames = []string{redirectMapOrigDst, redirectMapStats, redirectMapCgroupStats}

// reusableMaps opens the maps of reusedMapNames pinned under pinDir that are
// compatible with spec (same type, key, value, size); others are left out and
// replaced by fresh ones.
func reusableMaps(pinDir string, spec *ebpf.CollectionSpec, log *slog.Logger) map[string]*ebpf.Map {
	out := map[string]*ebpf.Map{}
	for _, name := range reusedMapNames {
		p := filepath.Join(pinDir, mapsDir, name)
		m, err := ebpf.LoadPinnedMap(p, nil)
		if err != nil {
			if !errors.Is(err, os.ErrNotExist) {
				log.Warn("cannot reuse pinned map, starting afresh", "map", p, "err", err)
			}
			continue
		}
		if err := spec.Maps[name].Compatible(m); err != nil {
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

// ownNetnsCookie is the cookie of the calling thread's network namespace.
func ownNetnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fd, err = unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return 0, fmt.Errorf("open socket: %w", err)
		}
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("getsockopt SO_NETNS_COOKIE (needs Linux 5.14): %w", err)
	}
	return c, nil
}

func addrWords(a netip.Addr) [4]uint32 {
	b := a.As16()
	var w [4]uint32
	for i := range w {
		w[i] = binary.NativeEndian.Uint32(b[4*i:])
	}
	return w
}

func (d *Datapath) writeConfig(netnsCookie uint64) error {
	s := d.set
	c := redirectMeshdnsConfig{
		BasePort:         s.basePort,
		NumSlots:         s.numSlots,
		AllSlot:          s.allSlot,
		Flags:            s.flags,
		UpstreamMark:     s.cfg.UpstreamMark,
		AgentNetnsCookie: netnsCookie,
	}
	if s.cfg.Target4.IsValid() {
		c.Target4 = addrWords(s.cfg.Target4.Addr())[3]
	}
	if s.cfg.Target6.IsValid() {
		c.Target6 = addrWords(s.cfg.Target6.Addr())
	}
	if err := d.objs.Config.Put(uint32(0), &c); err != nil {
		return fmt.Errorf("write config map: %w", err)
	}
	for i, ns := range s.nameservers {
		key := redirectNsKey{Addr: addrWords(ns)}
		if err := d.objs.Nameservers.Put(&key, uint32(i)); err != nil {
			return fmt.Errorf("write nameserver %s to map: %w", ns, err)
		}
	}
	for _, uid := range s.cfg.ProxyUIDs {
		if err := d.objs.ProxyUids.Put(uid, uint32(1)); err != nil {
			return fmt.Errorf("write proxy uid %d to map: %w", uid, err)
		}
	}
	return nil
}

func monotonicNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// writeState writes ready and a fresh heartbeat. Callers hold d.mu or own d.
func (d *Datapath) writeState(ready bool) error {
	now := monotonicNow()
	st := redirectMeshdnsState{HeartbeatNs: now}
	if ready {
		st.Ready = 1
	}
	if err := d.objs.State.Put(uint32(0), &st); err != nil {
		return fmt.Errorf("write state map: %w", err)
	}
	d.ready = ready
	d.lastHeartbeat = now
	return nil
}

func (d *Datapath) mapsByName() map[string]*ebpf.Map {
	m := d.objs.redirectMaps
	return map[string]*ebpf.Map{
		redirectMapCgroupStats: m.CgroupStats,
		redirectMapConfig:      m.Config,
		redirectMapNameservers: m.Nameservers,
		redirectMapOrigDst:     m.OrigDst,
		redirectMapProxyUids:   m.ProxyUids,
		redirectMapState:       m.State,
		redirectMapStats:       m.Stats,
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
		redirectProgSockRelease:  p.SockRelease,
	}
}

func (d *Datapath) pinMaps() error {
	dir := filepath.Join(d.pinDir, mapsDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	for name, m := range d.mapsByName() {
		p := filepath.Join(dir, name)
		if err := m.Pin(p); err != nil {
			return fmt.Errorf("pin map %s at %s: %w", name, p, err)
		}
	}
	return nil
}

func (d *Datapath) attach() error {
	cg, err := os.Open(d.set.cfg.Cgroup)
	if err != nil {
		return fmt.Errorf("open cgroup %s: %w", d.set.cfg.Cgroup, err)
	}
	defer cg.Close()
	dir := filepath.Join(d.pinDir, linksDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	progs := d.programsByName()
	for _, h := range hooks {
		l, err := link.AttachRawLink(link.RawLinkOptions{
			Target:  int(cg.Fd()),
			Program: progs[h.name],
			Attach:  h.attach,
		})
		if err != nil {
			hint := ""
			if errors.Is(err, unix.EPERM) {
				hint = " (another program may be attached to this cgroup exclusively, without BPF_F_ALLOW_MULTI)"
			}
			return fmt.Errorf("attach %s (%s) to cgroup %s: %w%s", h.section, h.attachName, d.set.cfg.Cgroup, err, hint)
		}
		a := attached{hook: h, link: l, pin: filepath.Join(dir, h.name)}
		d.links = append(d.links, a)
		if info, err := l.Info(); err == nil {
			d.links[len(d.links)-1].id = info.ID
		}
		if err := l.Pin(a.pin); err != nil {
			return fmt.Errorf("pin link of %s at %s: %w", h.section, a.pin, err)
		}
	}
	return nil
}

// teardown detaches and unpins everything d attached or pinned and closes its
// objects. It is used on Install errors and by Close(false).
func (d *Datapath) teardown() error {
	var errs []error
	for _, a := range d.links {
		if err := a.link.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) {
			errs = append(errs, fmt.Errorf("detach %s: %w", a.hook.section, err))
		}
		if err := a.link.Unpin(); err != nil {
			errs = append(errs, fmt.Errorf("unpin link %s: %w", a.pin, err))
		}
		if err := a.link.Close(); err != nil {
			errs = append(errs, fmt.Errorf("detach %s: %w", a.hook.section, err))
		}
	}
	d.links = nil
	for name, m := range d.mapsByName() {
		if m == nil {
			continue
		}
		if err := m.Unpin(); err != nil {
			errs = append(errs, fmt.Errorf("unpin map %s: %w", name, err))
		}
	}
	if err := d.objs.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close eBPF objects: %w", err))
	}
	d.objs = redirectObjects{}
	errs = append(errs, removeEmptyPinDirs(d.pinDir)...)
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

// SetReady switches capture on or off and writes a fresh heartbeat.
func (d *Datapath) SetReady(ready bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errors.New("datapath is closed")
	}
	return d.writeState(ready)
}

// Run refreshes the heartbeat every HeartbeatInterval until ctx is done. Without
// it the programs stop redirecting HeartbeatTimeout after the last SetReady.
func (d *Datapath) Run(ctx context.Context) {
	t := time.NewTicker(HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			return
		}
		err := d.writeState(d.ready)
		d.mu.Unlock()
		if err != nil {
			d.log.Error("write heartbeat", "err", err)
		}
	}
}

// Close stops capture. Without persist it detaches every program and removes
// every pin (and the pin directory when it is then empty). With persist it only
// sets the datapath not ready and closes its file descriptors: links and maps stay
// pinned (and attached, but failing open) for the next agent, which replaces them.
func (d *Datapath) Close(persist bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	var errs []error
	if err := d.writeState(false); err != nil {
		errs = append(errs, err)
	}
	if persist {
		for _, a := range d.links {
			if err := a.link.Close(); err != nil { // pinned: stays attached
				errs = append(errs, fmt.Errorf("close link %s: %w", a.hook.name, err))
			}
		}
		d.links = nil
		if err := d.objs.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close eBPF objects: %w", err))
		}
		d.log.Info("eBPF datapath left pinned (persist)", "pin_dir", d.pinDir)
		return errors.Join(errs...)
	}
	if err := d.teardown(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	d.log.Info("eBPF datapath detached", "cgroup", d.set.cfg.Cgroup)
	return nil
}

// Programs lists the attached programs.
func (d *Datapath) Programs() []ProgramInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
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
