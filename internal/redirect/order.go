package redirect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Running first. Another datapath's programs on the same hooks (Cilium's
// socket LB, Calico's connect-time LB) rewrite a Service ClusterIP to a
// backend; when one runs before ours, the kube-dns ClusterIP is a CoreDNS pod
// IP by the time ours looks. Kernels with ordered cgroup programs (Linux 6.16:
// BPF_F_BEFORE with no relative program means "in front of every program of
// this cgroup"; 6.15: BPF_F_PREORDER, "before the programs of descendant
// cgroups too") let ours go first whenever they attach. Older kernels refuse
// the flags (EINVAL); the datapath then attaches as before, in attach order.

// orderFlags put a link in front of every program that runs for the cgroup's
// sockets on its hook (a variable: a test gives it a flag every kernel
// refuses, to run an older kernel's refusal on this one).
var orderFlags uint32 = FlagBefore | FlagPreorder

// The kernel's flags for ordered cgroup programs (include/uapi/linux/bpf.h),
// spelt here so the package also builds where x/sys/unix lacks them (the
// non-Linux builds of `make vet`).
const (
	FlagBefore   = 1 << 3 // BPF_F_BEFORE
	FlagPreorder = 1 << 6 // BPF_F_PREORDER
)

// UnorderedEnv, set to 1 in the agent's environment, makes the datapath attach
// as on a kernel without ordered cgroup programs (a test switch: the coexistence
// tests run what an older kernel does on this one).
const UnorderedEnv = "MESHDNS_TEST_UNORDERED_ATTACH"

// Ordering says how the datapath's programs are placed among the others on
// the capture cgroup's hooks.
type Ordering struct {
	// Supported: the kernel took ordered attach flags (or a link adopted
	// before the first attach needed none); false on kernels without them
	// or with the test switch.
	Supported bool `json:"supported"`
	// Reason says why not, when not supported.
	Reason string `json:"reason,omitempty"`
	// Relinked counts adopted links that ran behind another program and were
	// replaced by a link in front.
	Relinked int `json:"relinked,omitempty"`
}

// ordersHook says whether h's place among other programs matters: the socket
// address hooks, where another datapath rewrites addresses.
func ordersHook(h hook) bool {
	switch h.attach {
	case ebpf.AttachCGroupInetEgress, ebpf.AttachCgroupInetSockRelease:
		return false
	}
	return true
}

// attachNew attaches prog for h to the cgroup cg, in front of the programs
// there when the kernel can, else after them.
func (d *Datapath) attachNew(cg *os.File, prog *ebpf.Program, h hook) (*link.RawLink, error) {
	if d.order.Supported && ordersHook(h) {
		l, err := link.AttachRawLink(link.RawLinkOptions{Target: int(cg.Fd()), Program: prog, Attach: h.attach, Flags: orderFlags})
		if err == nil {
			return l, nil
		}
		if !errors.Is(err, unix.EINVAL) {
			return nil, err
		}
		d.order = Ordering{Reason: fmt.Sprintf("the kernel refused ordered cgroup attach (%v)", err)}
		d.log.Info("no ordered cgroup programs on this kernel: ours run in attach order among other datapaths' programs", "err", err)
	}
	return link.AttachRawLink(link.RawLinkOptions{Target: int(cg.Fd()), Program: prog, Attach: h.attach})
}

// foreignBefore says whether a program other than ours (ours: our program IDs
// and the program of the link being adopted) runs before the first of ours
// for the cgroup's sockets on h.
func foreignBefore(cg *os.File, h hook, ours map[ebpf.ProgramID]bool) (bool, error) {
	eff, err := link.QueryPrograms(link.QueryOptions{Target: int(cg.Fd()), Attach: h.attach, QueryFlags: bpfQueryEffective})
	if err != nil {
		return false, fmt.Errorf("query %s programs: %w", h.name, err)
	}
	return len(eff.Programs) > 0 && !ours[eff.Programs[0].ID], nil
}

// relink puts prog in front of the others on h with a new link pinned at p in
// place of old (an adopted link that runs behind another program): the new
// link is attached first, so the hook never lacks our program, then the old
// pin is replaced and the old link detached.
func (d *Datapath) relink(cg *os.File, prog *ebpf.Program, h hook, old link.Link, p string) (link.Link, error) {
	nl, err := link.AttachRawLink(link.RawLinkOptions{Target: int(cg.Fd()), Program: prog, Attach: h.attach, Flags: orderFlags})
	if err != nil {
		return nil, fmt.Errorf("attach %s in front of the other programs: %w", h.name, err)
	}
	// bpffs takes no dot in a name; a start that finds this pin left by a
	// crash removes it with the other pins it does not know.
	tmp := filepath.Join(filepath.Dir(p), "new_"+filepath.Base(p))
	_ = os.Remove(tmp)
	if err := nl.Pin(tmp); err != nil {
		nl.Close()
		return nil, fmt.Errorf("pin the new link of %s: %w", h.name, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		_ = nl.Unpin()
		nl.Close()
		return nil, fmt.Errorf("replace the pin %s: %w", p, err)
	}
	if err := old.Detach(); err != nil && !errors.Is(err, link.ErrNotSupported) {
		d.log.Warn("detach the link that ran behind another program", "hook", h.name, "err", err)
	}
	old.Close()
	d.order.Relinked++
	return nl, nil
}

// programID is prog's kernel ID, 0 when unknown.
func programID(prog *ebpf.Program) ebpf.ProgramID {
	info, err := prog.Info()
	if err != nil {
		return 0
	}
	id, _ := info.ID()
	return id
}

// Ordering says how the datapath's programs were placed among the others.
func (d *Datapath) Ordering() Ordering {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.order
}
