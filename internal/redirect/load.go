package redirect

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// Load loads the programs and maps into the kernel (the verifier's work,
// reusing the compatible maps pinned under Config.PinDir) ahead of Start. It
// changes nothing the running programs see: no map is written, nothing is
// pinned or attached. A successor calls it before it asks for a handover, so
// that the slow part of its start is done while its predecessor still serves.
// Calling it is optional: Start loads what Load did not.
func (d *Datapath) Load(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.started || d.closed || d.loaded != nil {
		return errors.New("datapath already loaded, started or closed")
	}
	return d.loadLocked(ctx)
}

// loadLocked checks the environment, then loads the objects with the
// reusable pinned maps in place of their own.
func (d *Datapath) loadLocked(ctx context.Context) error {
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
	if g := spec.Maps["egress_grants"]; g != nil && d.set.cfg.EgressGrants > 0 {
		g.MaxEntries = uint32(d.set.cfg.EgressGrants)
	}
	reused := reusableMaps(d.pinDir, spec, d.log)
	defer closeMaps(reused) // the collection holds its own clones
	if err := d.loadObjects(spec, reused); err != nil {
		return err
	}
	d.loaded = &loaded{spec: spec, netns: netnsCookie, reused: mapIDs(reused)}
	return nil
}

// Start writes the programs' configuration and attaches every program to
// Config.Cgroup with a bpf_link pinned under Config.PinDir (links/<program>,
// maps/<map>), loading them first unless Load did. Links a previous agent left
// pinned there (a restart, an upgrade, a crash) are adopted: their programs are
// replaced in place, so capture has no gap, and the maps whose layout is
// unchanged are kept (the per-socket state of sockets redirected earlier, the
// registered resolver sockets of a running predecessor, the counters). Nothing
// is redirected until a resolver socket is registered with Serve. On error,
// what this Start attached or pinned is removed again; adopted links are left
// as they were.
func (d *Datapath) Start(ctx context.Context) (err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.started || d.closed {
		return errors.New("datapath already started or closed")
	}
	d.started = true
	if _, statErr := os.Stat(d.pinDir); errors.Is(statErr, os.ErrNotExist) {
		d.madePinDir = true
	}
	defer func() {
		if err != nil {
			// One release path, Close's: what this Start made goes again.
			_, _ = d.releaseLocked(true)
		}
	}()
	if err := d.reloadIfPinsChanged(ctx); err != nil {
		return err
	}
	ld := d.loaded
	if err := d.configure(ld.netns); err != nil {
		return err
	}
	if d.ownPins, err = d.pinMaps(ld.reused); err != nil {
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
	d.logStarted(slices.Sorted(maps.Keys(ld.reused)))
	return nil
}

// loaded is what Load did: the object's spec, the network namespace's
// cookie, and the IDs of the pinned maps the objects use as their own.
type loaded struct {
	spec   *ebpf.CollectionSpec
	netns  uint64
	reused map[string]ebpf.MapID
}

// reloadIfPinsChanged loads the objects when Load did not, or again when the
// maps pinned now are not those Load found (another agent replaced one in
// between): the objects must use the maps the pins name.
func (d *Datapath) reloadIfPinsChanged(ctx context.Context) error {
	if d.loaded != nil {
		// Load logged what it could not reuse; the same pins need not be logged again.
		now := reusableMaps(d.pinDir, d.loaded.spec, slog.New(slog.DiscardHandler))
		same := maps.Equal(mapIDs(now), d.loaded.reused)
		closeMaps(now)
		if same {
			return nil
		}
		d.log.Info("pinned maps changed since the programs were loaded; loading them again")
		if err := d.objs.Close(); err != nil {
			return fmt.Errorf("close eBPF objects: %w", err)
		}
		d.objs, d.loaded = redirectObjects{}, nil
	}
	return d.loadLocked(ctx)
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

// loadObjects loads the programs and maps, reused in place of their own.
func (d *Datapath) loadObjects(spec *ebpf.CollectionSpec, reused map[string]*ebpf.Map) error {
	if err := spec.LoadAndAssign(&d.objs, &ebpf.CollectionOptions{MapReplacements: reused}); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("load eBPF programs: the verifier rejected them: %+v", ve)
		}
		return fmt.Errorf("load eBPF programs: %w%s", err, permissionHint(err))
	}
	return nil
}

// configure writes the configuration and maps the shared memory (progress,
// flows) of the loaded objects.
func (d *Datapath) configure(netnsCookie uint64) (err error) {
	d.netns = netnsCookie
	d.set.flags |= keptEgressFlag(d.objs.Config)
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

func (d *Datapath) logStarted(kept []string) {
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
		"adopted_links", adopted, "kept_maps", kept, "watch_clock", d.clock != nil)
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

// mapIDs are the kernel's IDs of maps, by name.
func mapIDs(m map[string]*ebpf.Map) map[string]ebpf.MapID {
	out := make(map[string]ebpf.MapID, len(m))
	for name, mp := range m {
		if info, err := mp.Info(); err == nil {
			if id, ok := info.ID(); ok {
				out[name] = id
			}
		}
	}
	return out
}

func closeMaps(m map[string]*ebpf.Map) {
	for _, mp := range m {
		mp.Close()
	}
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

// mapsByName are the datapath's maps by their name in the object, read from
// the bpf2go struct's tags: the C source is the only list.
func (d *Datapath) mapsByName() map[string]*ebpf.Map {
	return byEBPFName[*ebpf.Map](d.objs.redirectMaps)
}

// programsByName are the datapath's programs by their name in the object.
func (d *Datapath) programsByName() map[string]*ebpf.Program {
	return byEBPFName[*ebpf.Program](d.objs.redirectPrograms)
}

// byEBPFName returns the fields of type T of a bpf2go struct (redirectMaps,
// redirectPrograms) by their `ebpf` tag: the name in the object.
func byEBPFName[T any](v any) map[string]T {
	rv := reflect.ValueOf(v)
	out := map[string]T{}
	for i := range rv.NumField() {
		name := rv.Type().Field(i).Tag.Get("ebpf")
		if x, ok := rv.Field(i).Interface().(T); ok && name != "" {
			out[name] = x
		}
	}
	return out
}

// pinMaps pins the maps that are not reused (replacing an incompatible pin of a
// previous version) and returns the pins it created.
func (d *Datapath) pinMaps(reused map[string]ebpf.MapID) ([]string, error) {
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
