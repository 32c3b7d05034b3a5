package redirect

import (
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf/asm"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The hook table names every program of the object, in enum hook order, and
// the counter names come from the C enums (BTF), so nothing is mirrored by hand.
func TestNamesMatchBPFObject(t *testing.T) {
	spec, err := loadRedirect()
	if err != nil {
		t.Fatal(err)
	}
	if len(hooks) != int(redirectHookNUM_HOOKS) || len(spec.Programs) != len(hooks) {
		t.Errorf("%d hooks in Go, NUM_HOOKS = %d, %d programs in the object", len(hooks), redirectHookNUM_HOOKS, len(spec.Programs))
	}
	for i, h := range hooks {
		p := spec.Programs[h.name]
		if p == nil {
			t.Errorf("no program %s in the object", h.name)
			continue
		}
		if p.SectionName != h.section || p.AttachType != h.attach {
			t.Errorf("program %s: section %s attach %v, Go says %s %v", h.name, p.SectionName, p.AttachType, h.section, h.attach)
		}
		if int(h.row) != i {
			t.Errorf("hook %s has row %d at index %d", h.name, h.row, i)
		}
	}
	want := []string{"redirected_udp", "redirected_tcp", "reply_rewritten", "skip_proxy", "skip_resolver",
		"skip_no_resolver", "skip_stalled", "skip_not_captured", "skip_loopback", "skip_other_netns", "skip_no_state", "map_miss",
		"flow_recorded", "flow_evicted", "flow_released", "backend_captured"}
	if got := CounterNames(); !reflect.DeepEqual(got, want) {
		t.Errorf("CounterNames() = %v, want %v", got, want)
	}
	if n := len(redirectHookCounters{}.Counters); n != len(CounterNames()) || n != int(redirectCounterNUM_COUNTERS) {
		t.Errorf("hook_counters has %d counters, %d names", n, len(CounterNames()))
	}
	if got := CgroupCounterNames(); !reflect.DeepEqual(got, []string{"redirected_udp", "redirected_tcp", "reply_rewritten", "skipped"}) {
		t.Errorf("CgroupCounterNames() = %v", got)
	}
	if n := spec.Maps["nameservers"].MaxEntries; n != uint32(maxNameservers) {
		t.Errorf("nameservers map has %d entries, MAX_NAMESERVERS = %d", n, maxNameservers)
	}
	js, err := json.Marshal(HookStats{Hook: "connect4", Counters: []uint64{1, 2}})
	if err != nil || !strings.HasPrefix(string(js), `{"hook":"connect4","redirected_udp":1,"redirected_tcp":2,"reply_rewritten":0,`) {
		t.Errorf("HookStats JSON %s %v", js, err)
	}
}

func TestSlotPortsAndValidate(t *testing.T) {
	a4 := netip.MustParseAddrPort("169.254.20.53:53")
	a6 := netip.MustParseAddrPort("[fd53::53]:53")
	nss := []netip.Addr{netip.MustParseAddr("10.0.0.10"), netip.MustParseAddr("10.0.0.11")}
	base := Config{Cgroup: "/x", PinDir: "/y", Target4: a4, Nameservers: nss, UpstreamMark: 1}
	tests := []struct {
		name      string
		mod       func(*Config)
		wantPorts []uint16
		wantErr   string
		wantFlags uint32
	}{
		{"two nameservers", func(*Config) {}, []uint16{53, 54}, "", flagTarget4},
		{"capture all adds its slots", func(c *Config) { c.CaptureAll = true }, []uint16{53, 54, 55, 56, 57, 58}, "", flagTarget4 | flagCaptureAll},
		{"capture all alone", func(c *Config) { c.CaptureAll = true; c.Nameservers = nil }, []uint16{53, 54, 55, 56}, "", flagTarget4 | flagCaptureAll},
		{"v6 only", func(c *Config) { c.Target4 = netip.AddrPort{}; c.Target6 = a6 }, []uint16{53, 54}, "", flagTarget6},
		{"both, loopback v4", func(c *Config) { c.Target4 = netip.MustParseAddrPort("127.0.0.1:53"); c.Target6 = a6 }, []uint16{53, 54}, "", flagTarget4 | flagTarget6 | flagTarget4Loopback},
		{"loopback capture", func(c *Config) { c.CaptureLoopback = true }, []uint16{53, 54}, "", flagTarget4 | flagCaptureLoopback},
		{"no target", func(c *Config) { c.Target4 = netip.AddrPort{} }, nil, "no resolver target", 0},
		{"v6 as target4", func(c *Config) { c.Target4 = a6 }, nil, "not a usable IPv4", 0},
		{"mapped target6", func(c *Config) { c.Target6 = netip.MustParseAddrPort("[::ffff:1.2.3.4]:53") }, nil, "not a usable IPv6", 0},
		{"no port", func(c *Config) { c.Target4 = netip.AddrPortFrom(a4.Addr(), 0) }, nil, "has no port", 0},
		{"duplicate nameserver", func(c *Config) { c.Nameservers = []netip.Addr{nss[0], netip.MustParseAddr("::ffff:10.0.0.10")} }, nil, "listed twice", 0},
		{"nameserver is target", func(c *Config) { c.Nameservers = []netip.Addr{a4.Addr()} }, nil, "resolver's own address", 0},
		{"ports overflow", func(c *Config) { c.Target4 = netip.AddrPortFrom(a4.Addr(), 65535) }, nil, "past 65535", 0},
		{"no mark", func(c *Config) { c.UpstreamMark = 0 }, nil, "upstream mark", 0},
		{"no cgroup", func(c *Config) { c.Cgroup = "" }, nil, "no cgroup", 0},
		{"no pin dir", func(c *Config) { c.PinDir = "" }, nil, "no pin directory", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			cfg.Nameservers = append([]netip.Addr(nil), base.Nameservers...)
			tc.mod(&cfg)
			s, err := validate(cfg)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("validate: %v, want error containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("validate: %v", err)
			}
			if s.flags != tc.wantFlags {
				t.Errorf("flags %#x, want %#x", s.flags, tc.wantFlags)
			}
			if got := SlotPorts(cfg); !reflect.DeepEqual(got, tc.wantPorts) {
				t.Errorf("SlotPorts = %v, want %v", got, tc.wantPorts)
			}
			if int(s.numSlots) != len(tc.wantPorts) || s.basePort != tc.wantPorts[0] {
				t.Errorf("numSlots %d basePort %d, want %d %d", s.numSlots, s.basePort, len(tc.wantPorts), tc.wantPorts[0])
			}
			if cfg.CaptureAll && int(s.allSlot) != len(cfg.Nameservers) {
				t.Errorf("allSlot %d, want %d", s.allSlot, len(cfg.Nameservers))
			}
		})
	}
}

func TestFeaturesMissing(t *testing.T) {
	f := Features{
		Hooks: []Feature{
			{Name: "cgroup/connect4", Detail: "BPF_CGROUP_INET4_CONNECT"},
			{Name: "cgroup/recvmsg4", Detail: "BPF_CGROUP_UDP4_RECVMSG", Err: errors.New("invalid argument")},
		},
		CgroupLink: Feature{Name: "bpf_link for cgroups", Err: errors.New("not supported")},
		BPFFS:      Feature{Name: "bpffs"},
	}
	want := []string{
		"cgroup/recvmsg4 (BPF_CGROUP_UDP4_RECVMSG): not supported by this kernel: invalid argument",
		"bpf_link for cgroups: not supported by this kernel: not supported",
	}
	if got := f.Missing(); !reflect.DeepEqual(got, want) {
		t.Errorf("Missing() = %q, want %q", got, want)
	}
}

// This kernel (the one CI runs on) has everything.
func TestProbe(t *testing.T) {
	testenv.RequirePrivileged(t)
	f, err := Probe()
	if err != nil {
		t.Fatalf("Probe: %v", err)
	}
	if len(f.Hooks) != len(hooks) {
		t.Errorf("%d hooks probed, want %d", len(f.Hooks), len(hooks))
	}
	if m := f.Missing(); len(m) != 0 {
		t.Errorf("missing on this kernel: %q", m)
	}
	for _, x := range append(f.Hooks, f.Helpers...) {
		t.Log(x)
	}
}

// The probe really asks the verifier: a helper the hook may not call is reported.
func TestProbeHookRejectsForbiddenHelper(t *testing.T) {
	testenv.RequirePrivileged(t)
	sendmsg4 := hooks[indexOfHook("sendmsg4")]
	// bpf_bind is only allowed in the connect hooks.
	err := probeHook(sendmsg4, callCtx(asm.FnBind))
	if err == nil {
		t.Fatal("bpf_bind in cgroup/sendmsg4 passed the probe")
	}
	f := Feature{Name: "bpf_bind", Detail: "in cgroup/sendmsg4", Err: err}
	if s := f.String(); !strings.HasPrefix(s, "bpf_bind (in cgroup/sendmsg4): not supported by this kernel: ") {
		t.Errorf("feature line %q", s)
	}
	if err := probeHook(hooks[indexOfHook("connect4")], callCtx(asm.FnGetNetnsCookie)); err != nil {
		t.Errorf("bpf_get_netns_cookie in cgroup/connect4: %v", err)
	}
}

const probeEnv = "MESHDNS_REDIRECT_PROBE_PROGRAMS"

// The programs load with CAP_BPF and CAP_NET_ADMIN only: without CAP_PERFMON
// the verifier applies its Spectre hardening (no variable offsets into map
// values), and the agent must not need more.
func TestProgramsLoadWithLeastPrivilege(t *testing.T) {
	testenv.RequirePrivileged(t, "setpriv")
	for _, caps := range [][]string{{"bpf", "net_admin"}, {"net_admin"}} {
		argv := append(testenv.OnlyCaps(caps), clientBin)
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = append(os.Environ(), probeEnv+"=1")
		out, err := cmd.CombinedOutput()
		if len(caps) == 2 && err != nil {
			t.Errorf("with %v the programs do not load: %v\n%s", caps, err, out)
		}
		if len(caps) == 1 && err == nil {
			t.Errorf("with %v (no CAP_BPF) the programs loaded: the check proves nothing", caps)
		}
	}
}

// The maps and programs the datapath pins, attaches and removes are exactly
// the object's (read from the bpf2go struct tags, not a list kept by hand).
func TestNamesFromTheObject(t *testing.T) {
	spec, err := loadRedirect()
	if err != nil {
		t.Fatal(err)
	}
	maps, progs := new(Datapath).mapsByName(), new(Datapath).programsByName()
	n := 0
	for name := range spec.Maps {
		if strings.HasPrefix(name, ".") {
			continue
		}
		n++
		if _, ok := maps[name]; !ok {
			t.Errorf("map %s of the object is not in mapsByName", name)
		}
	}
	if n != len(maps) || len(spec.Programs) != len(progs) {
		t.Errorf("mapsByName has %d maps, the object %d; programsByName %d programs, the object %d", len(maps), n, len(progs), len(spec.Programs))
	}
	for name := range spec.Programs {
		if _, ok := progs[name]; !ok {
			t.Errorf("program %s of the object is not in programsByName", name)
		}
	}
	for _, h := range hooks {
		if p := spec.Programs[h.name]; p == nil || p.SectionName != h.section || p.AttachType != h.attach {
			t.Errorf("hook %+v does not match the object's program %+v", h, p)
		}
	}
}
