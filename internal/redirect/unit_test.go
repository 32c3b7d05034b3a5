package redirect

import (
	"errors"
	"net/netip"
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/cilium/ebpf/asm"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The Go tables mirror the C enums (stats map rows and columns) name by name.
func TestNamesMatchBPFSource(t *testing.T) {
	src, err := os.ReadFile("../../bpf/redirect.c")
	if err != nil {
		t.Fatal(err)
	}
	enum := func(name, prefix string) []string {
		re := regexp.MustCompile(`(?s)enum ` + name + ` \{(.*?)\};`)
		m := re.FindSubmatch(src)
		if m == nil {
			t.Fatalf("enum %s not found in bpf/redirect.c", name)
		}
		var out []string
		for _, f := range strings.Split(string(m[1]), ",") {
			f = strings.TrimSpace(f)
			if f == "" || strings.HasPrefix(f, "NUM_") {
				continue
			}
			out = append(out, strings.ToLower(strings.TrimPrefix(f, prefix)))
		}
		return out
	}
	var hookNames []string
	for _, h := range hooks {
		hookNames = append(hookNames, h.name)
		if !strings.Contains(string(src), `SEC("`+h.section+`")`) {
			t.Errorf("no program in section %s", h.section)
		}
	}
	for _, c := range []struct {
		enum, prefix string
		goNames      []string
	}{
		{"hook", "HOOK_", hookNames},
		{"counter", "COUNTER_", counterNames},
		{"cgroup_counter", "CGROUP_", cgroupCounterNames},
	} {
		if got := enum(c.enum, c.prefix); !reflect.DeepEqual(got, c.goNames) {
			t.Errorf("enum %s = %v, Go has %v", c.enum, got, c.goNames)
		}
	}
	// Struct sizes the C side uses for the counters.
	if n := len(redirectHookCounters{}.Counters); n != len(counterNames) {
		t.Errorf("hook_counters has %d counters, Go names %d", n, len(counterNames))
	}
	if n := len(redirectCgroupCounters{}.Counters); n != len(cgroupCounterNames) {
		t.Errorf("cgroup_counters has %d counters, Go names %d", n, len(cgroupCounterNames))
	}
	var hs HookStats
	for i := range counterNames {
		*hs.counter(i) = uint64(i + 1)
	}
	v := reflect.ValueOf(hs)
	for i := range counterNames {
		if v.Field(i+1).Uint() != uint64(i+1) {
			t.Errorf("HookStats field %s is not counter %s", v.Type().Field(i+1).Name, counterNames[i])
		}
		if tag := v.Type().Field(i + 1).Tag.Get("json"); tag != counterNames[i] {
			t.Errorf("HookStats field %d has json tag %q, want %q", i+1, tag, counterNames[i])
		}
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
		{"capture all adds a slot", func(c *Config) { c.CaptureAll = true }, []uint16{53, 54, 55}, "", flagTarget4 | flagCaptureAll},
		{"capture all alone", func(c *Config) { c.CaptureAll = true; c.Nameservers = nil }, []uint16{53}, "", flagTarget4 | flagCaptureAll},
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
	if err := probeHook(hooks[indexOfHook("connect4")], callCtx(asm.FnGetSocketCookie)); err != nil {
		t.Errorf("bpf_get_socket_cookie in cgroup/connect4: %v", err)
	}
}
