// Package socklb is a test fixture: a socket load balancer of the tests' own
// (bpf/socklb.c) that does what Cilium's socket LB (bpf_sock, kube-proxy
// replacement) and Calico's connect-time load balancer do on the cgroup hooks
// the agent also uses: connect4/6 and sendmsg4/6 rewrite a Service address to
// a backend and remember it per socket, recvmsg4/6 and getpeername4/6 restore
// the Service address. TCPOnly translates TCP connects only, as Calico's
// bpfConnectTimeLoadBalancing: TCP does. Tests attach it to their own cgroup,
// before or after the agent's programs, to check that capture works beside it.
// The agent never loads it.
package socklb

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Options says what the load balancer translates and where it attaches.
type Options struct {
	// Services maps a Service address (ClusterIP and port) to its backend.
	Services map[netip.AddrPort]netip.AddrPort
	// TCPOnly translates TCP connects only (Calico's bpfConnectTimeLoadBalancing: TCP).
	TCPOnly bool
	// First attaches each program in front of those already on the hook
	// (BPF_F_BEFORE | BPF_F_PREORDER: a preordered program runs before the
	// others of its cgroup whatever their place), as a datapath that insists
	// on running first would.
	First bool
}

// LB is the attached load balancer.
type LB struct {
	objs  socklbObjects
	links []link.Link
}

// Attach loads the load balancer and attaches its eight programs to the
// cgroup v2 directory at path, after the programs already there (or before
// them with Options.First).
func Attach(path string, opts Options) (_ *LB, err error) {
	lb := &LB{}
	if err := loadSocklbObjects(&lb.objs, nil); err != nil {
		return nil, fmt.Errorf("load the test socket LB: %w", err)
	}
	defer func() {
		if err != nil {
			lb.Close()
		}
	}()
	cfg := socklbLbConfig{}
	if opts.TCPOnly {
		cfg.TcpOnly = 1
	}
	if err := lb.objs.LbSettings.Put(uint32(0), &cfg); err != nil {
		return nil, fmt.Errorf("write the socket LB's config: %w", err)
	}
	for svc, be := range opts.Services {
		k, v := key(svc), key(be)
		if err := lb.objs.Services.Put(&k, &v); err != nil {
			return nil, fmt.Errorf("write service %s: %w", svc, err)
		}
	}
	dir, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open cgroup: %w", err)
	}
	defer dir.Close()
	var flags uint32
	if opts.First {
		flags = flagBefore | flagPreorder
	}
	p := lb.objs.socklbPrograms
	for _, h := range []struct {
		prog   *ebpf.Program
		attach ebpf.AttachType
	}{
		{p.LbConnect4, ebpf.AttachCGroupInet4Connect},
		{p.LbConnect6, ebpf.AttachCGroupInet6Connect},
		{p.LbSendmsg4, ebpf.AttachCGroupUDP4Sendmsg},
		{p.LbSendmsg6, ebpf.AttachCGroupUDP6Sendmsg},
		{p.LbRecvmsg4, ebpf.AttachCGroupUDP4Recvmsg},
		{p.LbRecvmsg6, ebpf.AttachCGroupUDP6Recvmsg},
		{p.LbGetpeername4, ebpf.AttachCgroupInet4GetPeername},
		{p.LbGetpeername6, ebpf.AttachCgroupInet6GetPeername},
	} {
		l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(dir.Fd()), Program: h.prog, Attach: h.attach, Flags: flags})
		if err != nil {
			return nil, fmt.Errorf("attach the test socket LB (%s) to %s: %w", h.attach, path, err)
		}
		lb.links = append(lb.links, l)
	}
	return lb, nil
}

// key is an address in the maps' form: IPv4 as ::ffff:a.b.c.d, the port in
// network byte order.
func key(ap netip.AddrPort) socklbLbAddr {
	var k socklbLbAddr
	b := netip.AddrFrom16(ap.Addr().As16()).As16()
	for i := range k.Addr {
		k.Addr[i] = binary.NativeEndian.Uint32(b[4*i:])
	}
	var port [2]byte
	binary.BigEndian.PutUint16(port[:], ap.Port())
	k.Port = binary.NativeEndian.Uint16(port[:])
	return k
}

// Translated counts the destinations the load balancer rewrote to a backend.
func (lb *LB) Translated() uint64 { return lb.counter(socklbLbCounterLB_TRANSLATED) }

// Restored counts the backend addresses it turned back into the Service's.
func (lb *LB) Restored() uint64 { return lb.counter(socklbLbCounterLB_RESTORED) }

func (lb *LB) counter(c socklbLbCounter) uint64 {
	var v uint64
	if err := lb.objs.LbStats.Lookup(uint32(c), &v); err != nil {
		return 0
	}
	return v
}

// ProgramIDs are the IDs of its programs.
func (lb *LB) ProgramIDs() []uint32 {
	var ids []uint32
	for _, l := range lb.links {
		if info, err := l.Info(); err == nil {
			ids = append(ids, uint32(info.Program))
		}
	}
	return ids
}

// Close detaches the load balancer and releases it.
func (lb *LB) Close() error {
	var errs []error
	for _, l := range lb.links {
		errs = append(errs, l.Close())
	}
	lb.links = nil
	errs = append(errs, lb.objs.Close())
	return errors.Join(errs...)
}

// BPF_F_BEFORE and BPF_F_PREORDER (include/uapi/linux/bpf.h), spelt here so
// the package builds where x/sys/unix lacks them.
const (
	flagBefore   = 1 << 3
	flagPreorder = 1 << 6
)
