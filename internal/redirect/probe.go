package redirect

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// Feature is one kernel capability the datapath needs. Err is nil when the kernel
// has it.
type Feature struct {
	Name   string // e.g. "cgroup/recvmsg4"
	Detail string // e.g. "BPF_CGROUP_UDP4_RECVMSG"
	Err    error
}

func (f Feature) String() string {
	s := f.Name
	if f.Detail != "" {
		s += " (" + f.Detail + ")"
	}
	if f.Err == nil {
		return s + ": supported"
	}
	return s + ": not supported by this kernel: " + f.Err.Error()
}

// Features are the results of Probe.
type Features struct {
	Hooks      []Feature // one per program: cgroup/connect4 ... cgroup/sock_release
	Helpers    []Feature // helpers the programs call, per program type / hook
	MapTypes   []Feature // map types and flags the object uses
	CgroupLink Feature   // bpf_link for cgroups (attach and pin)
	BPFFS      Feature   // the bpf filesystem
	Programs   Feature   // the programs of bpf/redirect.c load (the verifier accepts them, with our privileges)
}

// Missing lists what this kernel lacks, one precise line per feature, e.g.
// "cgroup/recvmsg4 (BPF_CGROUP_UDP4_RECVMSG): not supported by this kernel: <err>".
// It is empty when the datapath can run.
func (f Features) Missing() []string {
	var out []string
	all := append(append(append([]Feature{}, f.Hooks...), f.Helpers...), f.MapTypes...)
	all = append(all, f.CgroupLink, f.BPFFS, f.Programs)
	for _, x := range all {
		if x.Err != nil {
			out = append(out, x.String())
		}
	}
	return out
}

// Probe asks the kernel, without attaching anything, whether it has every hook,
// helper, map type and bpf_link kind the datapath needs. The error is for probes
// that could not run at all (e.g. no permission to load BPF programs).
func Probe() (Features, error) {
	var f Features
	if err := rlimit.RemoveMemlock(); err != nil {
		return f, fmt.Errorf("remove memlock rlimit: %w", err)
	}
	for _, h := range hooks {
		f.Hooks = append(f.Hooks, Feature{Name: h.section, Detail: h.attachName, Err: probeHook(h, nil)})
	}
	if err := f.Hooks[0].Err; err != nil && (errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES)) {
		return f, fmt.Errorf("load a probe program: %w (needs CAP_BPF and CAP_NET_ADMIN)", err)
	}

	hookByName := map[string]hook{}
	for _, h := range hooks {
		hookByName[h.name] = h
	}
	helperProbes := []struct {
		hook   string
		name   string
		insns  func() (asm.Instructions, func(), error)
		detail string
	}{
		{"connect4", "bpf_get_netns_cookie", plain(callCtx(asm.FnGetNetnsCookie)), "in cgroup/connect4"},
		{"connect4", "bpf_get_current_cgroup_id", plain(callCtx(asm.FnGetCurrentCgroupId)), "in cgroup/connect4"},
		{"connect4", "bpf_getsockopt", plain(getsockoptMark()), "SO_MARK in cgroup/connect4"},
		{"sendmsg4", "bpf_getsockopt", plain(getsockoptMark()), "SO_MARK in cgroup/sendmsg4"},
		{"connect4", "bpf_map_lookup_elem on a SOCKMAP, bpf_sk_release", sockmapLookup, "resolver sockets, in cgroup/connect4"},
		{"sendmsg4", "bpf_sk_storage_get", skStorageGet, "per-socket state, in cgroup/sendmsg4"},
		{"recvmsg4", "bpf_sk_storage_get", skStorageGet, "per-socket state, in cgroup/recvmsg4"},
		{"connect4", "bpf_get_current_pid_tgid", plain(callCtx(asm.FnGetCurrentPidTgid)), "the sender's process, in cgroup/connect4"},
		{"attribute", "bpf_sk_fullsock, bpf_sk_storage_get", skbStorageGet, "per-socket state, in cgroup_skb/egress"},
		{"attribute", "bpf_skb_load_bytes", skbLoadBytes, "the packet's addresses, in cgroup_skb/egress"},
		{"attribute", "bpf_get_socket_cookie", plain(callCtx(asm.FnGetSocketCookie)), "in cgroup_skb/egress"},
		{"sock_release", "bpf_sk_storage_get", sockStorageGet, "per-socket state, in cgroup/sock_release"},
		{"sock_release", "bpf_get_socket_cookie", plain(callCtx(asm.FnGetSocketCookie)), "in cgroup/sock_release"},
	}
	for _, p := range helperProbes {
		h := hookByName[p.hook]
		err := error(nil)
		if hookErr := f.Hooks[indexOfHook(p.hook)].Err; hookErr != nil {
			err = fmt.Errorf("hook %s is missing", h.section)
		} else if insns, cleanup, ierr := p.insns(); ierr != nil {
			err = ierr
		} else {
			err = probeHook(h, insns)
			cleanup()
		}
		f.Helpers = append(f.Helpers, Feature{Name: p.name, Detail: p.detail, Err: err})
	}
	for _, mt := range []ebpf.MapType{ebpf.Hash, ebpf.Array, ebpf.PerCPUArray, ebpf.LRUCPUHash, ebpf.SockMap, ebpf.SkStorage} {
		f.MapTypes = append(f.MapTypes, Feature{Name: "map type " + mt.String(), Err: features.HaveMapType(mt)})
	}
	f.MapTypes = append(f.MapTypes, Feature{Name: "BPF_F_MMAPABLE arrays", Detail: "resolver progress, Linux 5.5", Err: features.HaveMapFlag(features.BPF_F_MMAPABLE)})
	f.CgroupLink = Feature{Name: "bpf_link for cgroups", Detail: "BPF_LINK_CREATE, Linux 5.7", Err: probeCgroupLink()}
	f.BPFFS = Feature{Name: "bpffs", Detail: "filesystem type bpf", Err: probeBPFFS()}
	f.Programs = Feature{Name: "eBPF programs", Detail: "bpf/redirect.c, with this process's privileges", Err: probePrograms()}
	return f, nil
}

// probePrograms loads the datapath's programs and maps, attaching nothing: the
// verifier's last word, with this process's capabilities (without CAP_PERFMON
// it is stricter).
func probePrograms() error {
	spec, err := loadRedirect()
	if err != nil {
		return err
	}
	var objs redirectObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return fmt.Errorf("the verifier rejected them: %+v", ve)
		}
		return err
	}
	return objs.Close()
}

func indexOfHook(name string) int {
	for i, h := range hooks {
		if h.name == name {
			return i
		}
	}
	panic("unknown hook " + name)
}

func returnOne() asm.Instructions {
	return asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}
}

func plain(insns asm.Instructions) func() (asm.Instructions, func(), error) {
	return func() (asm.Instructions, func(), error) { return insns, func() {}, nil }
}

// sockmapLookup looks up key 0 of a SOCKMAP and releases what it found, as the
// forward path does with resolver_socks.
func sockmapLookup() (asm.Instructions, func(), error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockMap, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return nil, nil, fmt.Errorf("create a SOCKMAP: %w", err)
	}
	return asm.Instructions{
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.StoreImm(asm.R10, -4, 0, asm.Word),
		asm.Mov.Reg(asm.R2, asm.R10),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Reg(asm.R1, asm.R0),
		asm.FnSkRelease.Call(),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
		asm.Return(),
	}, func() { m.Close() }, nil
}

// skStorageGet reads the socket-local storage of ctx->sk without creating it.
func skStorageGet() (asm.Instructions, func(), error) {
	m, err := skStorageMap()
	if err != nil {
		return nil, nil, err
	}
	return storageGet(m, asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, int16(unsafe.Offsetof(sockAddrCtx{}.sk)), asm.DWord),
		asm.JEq.Imm(asm.R2, 0, "out"),
	}), func() { m.Close() }, nil
}

// storageGet is find (which leaves a socket in R2, or jumps to "out"), then
// bpf_sk_storage_get on m without creating, then return 1 ("out").
func storageGet(m *ebpf.Map, find asm.Instructions) asm.Instructions {
	return append(find,
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.Mov.Imm(asm.R3, 0),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnSkStorageGet.Call(),
		asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
		asm.Return(),
	)
}

// skStorageMap is an SK_STORAGE map like sock_state, for a probe.
func skStorageMap() (*ebpf.Map, error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{
		Type: ebpf.SkStorage, KeySize: 4, ValueSize: 8, Flags: bpfNoPrealloc,
		Key: &btf.Int{Name: "int", Size: 4, Encoding: btf.Signed}, Value: &btf.Int{Name: "long long unsigned int", Size: 8},
	})
	if err != nil {
		return nil, fmt.Errorf("create an SK_STORAGE map: %w", err)
	}
	return m, nil
}

// skbStorageGet reads the socket-local storage of a packet's full socket, as
// attribute does.
func skbStorageGet() (asm.Instructions, func(), error) {
	m, err := skStorageMap()
	if err != nil {
		return nil, nil, err
	}
	return storageGet(m, asm.Instructions{
		asm.LoadMem(asm.R1, asm.R1, skbSkOffset, asm.DWord),
		asm.JEq.Imm(asm.R1, 0, "out"),
		asm.FnSkFullsock.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Reg(asm.R2, asm.R0),
	}), func() { m.Close() }, nil
}

// skbLoadBytes copies 4 bytes of the packet to the stack.
func skbLoadBytes() (asm.Instructions, func(), error) {
	return append(asm.Instructions{
		asm.Mov.Imm(asm.R2, 0),
		asm.Mov.Reg(asm.R3, asm.R10),
		asm.Add.Imm(asm.R3, -4),
		asm.Mov.Imm(asm.R4, 4),
		asm.FnSkbLoadBytes.Call(),
	}, returnOne()...), func() {}, nil
}

// sockStorageGet reads the socket-local storage of the socket that
// sock_release is given.
func sockStorageGet() (asm.Instructions, func(), error) {
	m, err := skStorageMap()
	if err != nil {
		return nil, nil, err
	}
	return storageGet(m, asm.Instructions{asm.Mov.Reg(asm.R2, asm.R1)}), func() { m.Close() }, nil
}

// skbSkOffset is the offset of sk in struct __sk_buff.
const skbSkOffset = 168

// sockAddrCtx is struct bpf_sock_addr up to its sk pointer.
type sockAddrCtx struct {
	userFamily uint32
	userIP4    uint32
	userIP6    [4]uint32
	userPort   uint32
	family     uint32
	typ        uint32
	protocol   uint32
	msgSrcIP4  uint32
	msgSrcIP6  [4]uint32
	sk         uint64
}

// callCtx calls fn(ctx) and returns 1.
func callCtx(fn asm.BuiltinFunc) asm.Instructions {
	return append(asm.Instructions{fn.Call()}, returnOne()...)
}

// getsockoptMark calls bpf_getsockopt(ctx, SOL_SOCKET, SO_MARK, &v, 4).
func getsockoptMark() asm.Instructions {
	return append(asm.Instructions{
		asm.StoreImm(asm.R10, -4, 0, asm.Word),
		asm.Mov.Imm(asm.R2, solSocket),
		asm.Mov.Imm(asm.R3, soMark),
		asm.Mov.Reg(asm.R4, asm.R10),
		asm.Add.Imm(asm.R4, -4),
		asm.Mov.Imm(asm.R5, 4),
		asm.FnGetsockopt.Call(),
	}, returnOne()...)
}

// probeHook loads a program of h's type and attach type (just "return 1" when
// insns is nil).
func probeHook(h hook, insns asm.Instructions) error {
	if insns == nil {
		insns = returnOne()
	}
	typ := ebpf.CGroupSockAddr
	switch h.attach {
	case ebpf.AttachCgroupInetSockRelease:
		typ = ebpf.CGroupSock
	case ebpf.AttachCGroupInetEgress:
		typ = ebpf.CGroupSKB
	}
	prog, err := ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Name:         "meshdns_probe",
		Type:         typ,
		AttachType:   h.attach,
		Instructions: insns,
		License:      "GPL",
	}, ebpf.ProgramOptions{LogDisabled: true})
	if err != nil {
		return err
	}
	return prog.Close()
}

// probeCgroupLink tries BPF_LINK_CREATE with a file that is not a cgroup: a
// kernel with cgroup bpf_links answers EBADF.
func probeCgroupLink() error {
	prog, err := ebpf.NewProgramWithOptions(&ebpf.ProgramSpec{
		Type:         ebpf.CGroupSockAddr,
		AttachType:   ebpf.AttachCGroupInet4Connect,
		Instructions: returnOne(),
		License:      "GPL",
	}, ebpf.ProgramOptions{LogDisabled: true})
	if err != nil {
		return fmt.Errorf("load probe program: %w", err)
	}
	defer prog.Close()
	f, err := os.Open(os.DevNull)
	if err != nil {
		return err
	}
	defer f.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(f.Fd()), Program: prog, Attach: ebpf.AttachCGroupInet4Connect})
	if err == nil {
		l.Close()
		return nil
	}
	if errors.Is(err, unix.EBADF) {
		return nil
	}
	return err
}

func probeBPFFS() error {
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return fmt.Errorf("read /proc/filesystems: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(strings.TrimPrefix(line, "nodev")) == "bpf" {
			return nil
		}
	}
	return errors.New("bpf is not listed in /proc/filesystems")
}
