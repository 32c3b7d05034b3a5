package redirect

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Socket is one listening socket of the resolver: a UDP socket or a TCP
// listener bound to a target address on a slot port.
type Socket struct {
	Addr netip.AddrPort // bound address: a target address and slot port
	TCP  bool
	Conn syscall.Conn // *net.UDPConn, *net.TCPListener, *os.File...
}

// Serve registers the resolver's sockets: from then on the programs redirect
// to each slot whose socket is registered, for its family and protocol (give one
// socket per address, port and protocol; of a SO_REUSEPORT group, any member).
// The kernel unregisters a socket when it is closed, so a resolver that dies
// stops being redirected to at once. Serve replaces earlier registrations of
// the same slots. Sockets whose address is not a target or whose port is not a
// slot port are an error.
func (d *Datapath) Serve(socks []Socket) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed || d.objs.ResolverSocks == nil {
		return errors.New("datapath is not started or closed")
	}
	for _, s := range socks {
		if err := d.serveLocked(s); err != nil {
			return err
		}
	}
	// A watch a previous resolver left (it stopped with a redirect unanswered)
	// says nothing about this one: start afresh.
	if d.progress != nil {
		atomic.StoreUint64(d.progress.field(unsafe.Offsetof(redirectMeshdnsProgress{}.WatchSince)), 0)
	}
	return nil
}

func (d *Datapath) serveLocked(s Socket) error {
	key, err := registerSocket(d.objs.ResolverSocks, d.set.cfg.Target4, d.set.cfg.Target6, d.set.basePort, d.set.numSlots, s)
	if err != nil {
		return err
	}
	d.served = append(d.served, key)
	return nil
}

// registerSocket puts s into resolver_socks m at the key of its family,
// protocol and slot.
func registerSocket(m *ebpf.Map, target4, target6 netip.AddrPort, basePort, numSlots uint16, s Socket) (uint32, error) {
	a := netip.AddrPortFrom(s.Addr.Addr().Unmap(), s.Addr.Port())
	var v6 bool
	switch {
	case target4.IsValid() && a.Addr() == target4.Addr():
	case target6.IsValid() && a.Addr() == target6.Addr():
		v6 = true
	default:
		return 0, fmt.Errorf("resolver socket %s is not on a target address", a)
	}
	slot := int(a.Port()) - int(basePort)
	if slot < 0 || slot >= int(numSlots) {
		return 0, fmt.Errorf("resolver socket %s is not on a slot port (%d..%d)", a, basePort, int(basePort)+int(numSlots)-1)
	}
	rc, err := s.Conn.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("resolver socket %s: %w", a, err)
	}
	key := resolverSockIndex(v6, s.TCP, slot)
	var perr error
	if err := rc.Control(func(fd uintptr) { perr = m.Put(key, uint64(fd)) }); err != nil {
		return 0, fmt.Errorf("resolver socket %s: %w", a, err)
	}
	if perr != nil {
		hint := ""
		if errors.Is(perr, unix.EOPNOTSUPP) {
			hint = " (a SOCKMAP takes bound UDP sockets and listening TCP sockets; not MPTCP, which Go's net.Listen picks by default)"
		}
		return 0, fmt.Errorf("register resolver socket %s (%s) in resolver_socks: %w%s", a, protoName(s.TCP), perr, hint)
	}
	return key, nil
}

func protoName(tcp bool) string {
	if tcp {
		return "tcp"
	}
	return "udp"
}

// Unserve unregisters the sockets Serve registered: capture stops for new
// queries (replies to redirected sockets are still restored).
func (d *Datapath) Unserve() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.unserveLocked()
}

func (d *Datapath) unserveLocked() error {
	if d.objs.ResolverSocks == nil {
		d.served = nil
		return nil
	}
	var errs []error
	for _, k := range d.served {
		if err := d.objs.ResolverSocks.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, fmt.Errorf("unregister resolver socket %d: %w", k, err))
		}
	}
	d.served = nil
	return errors.Join(errs...)
}

// progress is the memory-mapped progress map (struct meshdns_progress).
type progress struct {
	mem []byte
}

func mapProgress(m *ebpf.Map) (*progress, error) {
	size := unix.Getpagesize()
	mem, err := unix.Mmap(m.FD(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("memory-map the progress map: %w", err)
	}
	if len(mem) < int(unsafe.Sizeof(redirectMeshdnsProgress{})) {
		_ = unix.Munmap(mem)
		return nil, errors.New("progress map mapping is too small")
	}
	return &progress{mem: mem}, nil
}

func (p *progress) field(off uintptr) *uint64 {
	return (*uint64)(unsafe.Pointer(&p.mem[off]))
}

func (p *progress) load(off uintptr) uint64 { return atomic.LoadUint64(p.field(off)) }

func (p *progress) close() { _ = unix.Munmap(p.mem) }

// Dequeued records that the resolver read n datagrams, or accepted n
// connections, from sockets the programs redirect to. The resolver's read
// loops call it for every read (an atomic add on shared memory, no syscall):
// it is what tells a live resolver from a stalled one. Do not call it after
// Close.
func (d *Datapath) Dequeued(n int) {
	if c := d.dequeued.Load(); c != nil {
		atomic.AddUint64(c, uint64(n))
	}
}

// watchdogInterval is how often the watchdog looks at the progress watch.
const watchdogInterval = 20 * time.Millisecond

// watchdog keeps a live resolver from being taken for a stalled one when the
// programs redirected something that never reached it (a connect() without a
// send): when a watch ages past a quarter of the stall timeout with nothing
// dequeued, it sends the resolver an empty datagram, which the resolver's read
// loop dequeues (and counts) like any query. A resolver whose read loops are
// stuck or frozen does not dequeue it, and the programs fail open.
func (d *Datapath) watchdog(ctx context.Context) {
	defer close(d.wdDone)
	t := time.NewTicker(watchdogInterval)
	defer t.Stop()
	target := d.set.cfg.Target4
	if !target.IsValid() {
		target = d.set.cfg.Target6
	}
	dst := net.UDPAddrFromAddrPort(target)
	offSince := unsafe.Offsetof(redirectMeshdnsProgress{}.WatchSince)
	offCount := unsafe.Offsetof(redirectMeshdnsProgress{}.WatchCount)
	offDeq := unsafe.Offsetof(redirectMeshdnsProgress{}.Dequeued)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.mu.Lock()
		p, serving := d.progress, len(d.served) > 0
		d.mu.Unlock()
		if p == nil || !serving {
			continue
		}
		since := p.load(offSince)
		if since == 0 || p.load(offCount) != p.load(offDeq) {
			continue
		}
		if age := time.Duration(monotonicNow() - since); age < d.set.cfg.StallAfter/4 {
			continue
		}
		if _, err := d.probe.WriteToUDP(nil, dst); err != nil {
			d.log.Debug("send the resolver liveness probe", "err", err)
		}
	}
}

func monotonicNow() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint64(ts.Nano())
}

// Registration is a resolver in another process than the agent's datapath,
// registered with the datapath pinned under a pin directory: its sockets are
// redirected to, and its reads are its progress.
type Registration struct {
	socks    *ebpf.Map
	progress *progress
	keys     []uint32
}

// Register registers socks with the datapath pinned under pinDir, as Serve does
// for the agent's own resolver. The caller counts its reads with Dequeued.
func Register(pinDir string, socks []Socket) (*Registration, error) {
	cfgMap, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, mapsDir, redirectMapConfig), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open the pinned datapath config: %w", err)
	}
	defer cfgMap.Close()
	var c redirectMeshdnsConfig
	if err := cfgMap.Lookup(uint32(0), &c); err != nil {
		return nil, fmt.Errorf("read the datapath config: %w", err)
	}
	r := &Registration{}
	if r.socks, err = ebpf.LoadPinnedMap(filepath.Join(pinDir, mapsDir, redirectMapResolverSocks), nil); err != nil {
		return nil, fmt.Errorf("open the pinned resolver_socks map: %w", err)
	}
	pm, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, mapsDir, redirectMapProgress), nil)
	if err != nil {
		r.socks.Close()
		return nil, fmt.Errorf("open the pinned progress map: %w", err)
	}
	r.progress, err = mapProgress(pm)
	pm.Close() // the mapping keeps the map
	if err != nil {
		r.socks.Close()
		return nil, err
	}
	var t4, t6 netip.AddrPort
	if c.Flags&flagTarget4 != 0 {
		var b [4]byte
		binary.NativeEndian.PutUint32(b[:], c.Target4)
		t4 = netip.AddrPortFrom(netip.AddrFrom4(b), c.BasePort)
	}
	if c.Flags&flagTarget6 != 0 {
		t6 = netip.AddrPortFrom(wordsAddr(c.Target6), c.BasePort)
	}
	for _, s := range socks {
		key, err := registerSocket(r.socks, t4, t6, c.BasePort, c.NumSlots, s)
		if err != nil {
			r.Close()
			return nil, err
		}
		r.keys = append(r.keys, key)
	}
	return r, nil
}

// Dequeued counts n reads (see Datapath.Dequeued).
func (r *Registration) Dequeued(n int) {
	atomic.AddUint64(r.progress.field(unsafe.Offsetof(redirectMeshdnsProgress{}.Dequeued)), uint64(n))
}

// Close unregisters the sockets.
func (r *Registration) Close() error {
	var errs []error
	for _, k := range r.keys {
		if err := r.socks.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	r.progress.close()
	errs = append(errs, r.socks.Close())
	return errors.Join(errs...)
}
