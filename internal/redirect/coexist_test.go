package redirect

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
)

// namedPassProgram is passProgram with a program name, as another datapath's.
func namedPassProgram(t *testing.T, name string, attach ebpf.AttachType) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: name, Type: ebpf.CGroupSockAddr, AttachType: attach, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

func attachForeign(t *testing.T, cgroup, name string, attach ebpf.AttachType) uint32 {
	t.Helper()
	prog := namedPassProgram(t, name, attach)
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: attach, Program: prog})
	if err != nil {
		t.Fatalf("attach %s to %s: %v", name, cgroup, err)
	}
	t.Cleanup(func() { l.Close() })
	info, err := prog.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return uint32(id)
}

// Other programs on the capture cgroup's hooks (another datapath: Cilium's socket
// LB, Calico's) are listed with the order the kernel runs them in, ours among
// them, by the running datapath and by the CLI's status (from the pins), and
// counted before and after ours. Ours run in front of one attached before them
// where the kernel orders cgroup programs; with that switched off (as on an
// older kernel) they run in attach order.
func TestForeignProgramsListed(t *testing.T) {
	t.Run("ordered", func(t *testing.T) { testForeignProgramsListed(t, false) })
	t.Run("unordered", func(t *testing.T) { testForeignProgramsListed(t, true) })
}

func testForeignProgramsListed(t *testing.T, unordered bool) {
	n := newTestNet(t)
	// The capture cgroup is a child of the test cgroup, so a program attached to
	// the parent is inherited (it runs after the child's own).
	capture := filepath.Join(n.cg.Path, "capture")
	if err := os.Mkdir(capture, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(capture) })
	before := attachForeign(t, capture, "other_lb", ebpf.AttachCGroupInet4Connect)
	parent := attachForeign(t, n.cg.Path, "parent_connect", ebpf.AttachCGroupInet4Connect)

	cfg := n.config()
	cfg.Cgroup = capture
	cfg.Unordered = unordered
	d := n.start(t, cfg)
	if got := d.Ordering().Supported; got == unordered {
		t.Errorf("ordering supported %v, want %v", got, !unordered)
	}
	after := attachForeign(t, capture, "late_sendmsg", ebpf.AttachCGroupUDP4Sendmsg)

	ours := map[string]uint32{}
	for _, p := range d.Programs() {
		ours[p.Hook] = p.ProgramID
	}
	type row struct {
		id              uint32
		name            string
		ours, inherited bool
	}
	connect4 := []row{{ours["connect4"], "connect4", true, false}, {before, "other_lb", false, false}, {parent, "parent_connect", false, true}}
	connectBefore, connectAfter := 0, 2
	if unordered {
		connect4[0], connect4[1] = connect4[1], connect4[0]
		connectBefore, connectAfter = 1, 1
	}
	want := map[string][]row{
		"connect4": connect4,
		"sendmsg4": {{ours["sendmsg4"], "sendmsg4", true, false}, {after, "late_sendmsg", false, false}},
		"recvmsg4": {{ours["recvmsg4"], "recvmsg4", true, false}},
	}
	check := func(what string, progs []CgroupProgram) {
		t.Helper()
		got := map[string][]row{}
		for _, p := range progs {
			if p.Position != len(got[p.Hook])+1 {
				t.Errorf("%s: %s program %d at position %d, want %d", what, p.Hook, p.ProgramID, p.Position, len(got[p.Hook])+1)
			}
			got[p.Hook] = append(got[p.Hook], row{p.ProgramID, p.Name, p.Ours, p.Inherited})
		}
		for hook, w := range want {
			if !slices.Equal(got[hook], w) {
				t.Errorf("%s: %s runs %+v, want %+v", what, hook, got[hook], w)
			}
		}
		counts := ForeignPrograms(progs)
		if c := counts["connect4"]; c.Before != connectBefore || c.After != connectAfter {
			t.Errorf("%s: connect4 foreign programs %+v, want %d before and %d after", what, c, connectBefore, connectAfter)
		}
		if c := counts["sendmsg4"]; c.Before != 0 || c.After != 1 {
			t.Errorf("%s: sendmsg4 foreign programs %+v, want 1 after", what, c)
		}
		if c := counts["recvmsg6"]; c.Before != 0 || c.After != 0 {
			t.Errorf("%s: recvmsg6 foreign programs %+v, want none", what, c)
		}
	}
	progs, err := d.CgroupPrograms()
	if err != nil {
		t.Fatal(err)
	}
	check("datapath", progs)
	st, err := ReadStatus(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	if st.CgroupProgramsError != "" {
		t.Fatalf("status: %s", st.CgroupProgramsError)
	}
	check("status", st.CgroupPrograms)
	var out strings.Builder
	if err := st.WriteText(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"ORDER", "OWNER", "other_lb", "parent_connect", "an ancestor", "late_sendmsg"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status text lacks %q:\n%s", want, out.String())
		}
	}
	t.Logf("status:\n%s", out.String())
}

// A restart adopts links pinned behind another datapath's program (attached on
// an older kernel, or before the other datapath attached in front of them): on
// a kernel that orders cgroup programs, the new agent replaces each by a link
// in front, pinned in its place, and the old one is gone from the hook.
func TestAdoptionPutsOursFirst(t *testing.T) {
	n, foreign := pinnedBehindForeign(t)

	d := n.start(t, n.config()) // ordered; detaches at the end
	if got := d.Ordering(); !got.Supported || got.Relinked != 1 {
		t.Errorf("ordering %+v, want supported with connect4's link (the one behind another program) relinked", got)
	}
	progs, err := d.CgroupPrograms()
	if err != nil {
		t.Fatal(err)
	}
	var ours uint32
	for _, p := range d.Programs() {
		if p.Hook == "connect4" {
			ours = p.ProgramID
		}
	}
	if c := connect4IDs(progs); !slices.Equal(c, []uint32{ours, foreign}) {
		t.Errorf("after the restart connect4 runs %v, want ours (%d) then the foreign program (%d), once each", c, ours, foreign)
	}
	for _, c := range ForeignPrograms(progs) {
		if c.Before != 0 {
			t.Errorf("foreign programs before ours after the restart: %+v", ForeignPrograms(progs))
			break
		}
	}
	st, err := ReadStatus(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	if c := connect4IDs(st.CgroupPrograms); !slices.Equal(c, []uint32{ours, foreign}) {
		t.Errorf("status (from the pins): connect4 runs %v, want [%d %d]", c, ours, foreign)
	}
	rs := n.query(t, proc{uid: userUID}, "-mode=connect", "-dst="+hp(ns1, 53))
	if len(rs) != 1 {
		t.Fatalf("got %d results", len(rs))
	}
	wantCaptured(t, rs[0], 4, 0, hp(ns1, 53), hp(ns1, 53))
}

// pinnedBehindForeign is what a restart may find: another datapath's connect4
// program on the test cgroup, and behind it our links, attached without order
// and left pinned by a first agent that stopped. It returns the foreign
// program's ID.
func pinnedBehindForeign(t *testing.T) (*testNet, uint32) {
	t.Helper()
	n := newTestNet(t)
	foreign := attachForeign(t, n.cg.Path, "other_lb", ebpf.AttachCGroupInet4Connect)
	cfg := n.config()
	cfg.Unordered = true
	cfg.Detach = false
	first, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	n.startDatapath(t, first)
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	progs, err := QueryCgroupPrograms(n.cg.Path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c := connect4IDs(progs); len(c) != 2 || c[0] != foreign {
		t.Fatalf("before the restart connect4 runs %v, want the foreign program %d first", c, foreign)
	}
	return n, foreign
}

func connect4IDs(progs []CgroupProgram) []uint32 {
	var ids []uint32
	for _, p := range progs {
		if p.Hook == "connect4" {
			ids = append(ids, p.ProgramID)
		}
	}
	return ids
}

// On a kernel that refuses ordered attach, a restart that adopts links pinned
// behind another program starts anyway: the links keep their place, the
// refusal is reported, and capture works for what reaches ours.
func TestAdoptionWithoutOrderedAttach(t *testing.T) {
	n, foreign := pinnedBehindForeign(t)
	saved := orderFlags
	orderFlags = 1 << 30 // no kernel knows this flag: EINVAL, as before Linux 6.16
	t.Cleanup(func() { orderFlags = saved })

	d := n.start(t, n.config())
	if got := d.Ordering(); got.Supported || got.Reason == "" || got.Relinked != 0 {
		t.Errorf("ordering %+v, want unsupported with the kernel's refusal as reason", got)
	}
	progs, err := d.CgroupPrograms()
	if err != nil {
		t.Fatal(err)
	}
	if c := connect4IDs(progs); len(c) != 2 || c[0] != foreign {
		t.Errorf("connect4 runs %v, want the foreign program %d still first", c, foreign)
	}
	rs := n.query(t, proc{uid: userUID}, "-mode=connect", "-dst="+hp(ns1, 53))
	if len(rs) != 1 {
		t.Fatalf("got %d results", len(rs))
	}
	wantCaptured(t, rs[0], 4, 0, hp(ns1, 53), hp(ns1, 53))
}
