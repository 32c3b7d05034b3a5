package ctzone

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// saveOurs returns the lines of `iptables-save` (and `ip6tables-save` when v6)
// of backend in namespace ns that belong to us: chain declarations and rules
// that mention a MESHDNS- chain, with table headers, counters stripped.
func saveOurs(t *testing.T, ns, backend string, v6 bool) string {
	t.Helper()
	tools := []string{"iptables-" + backend + "-save"}
	if v6 {
		tools = append(tools, "ip6tables-"+backend+"-save")
	}
	var b strings.Builder
	for _, tool := range tools {
		out, err := exec.Command("ip", "netns", "exec", ns, tool).CombinedOutput()
		if err != nil {
			t.Fatalf("%s in %s: %v: %s", tool, ns, err, out)
		}
		table := ""
		for _, l := range strings.Split(string(out), "\n") {
			switch {
			case strings.HasPrefix(l, "*"):
				table = l
			case strings.Contains(l, chainPrefix):
				if i := strings.Index(l, " ["); strings.HasPrefix(l, ":") && i > 0 {
					l = l[:i]
				}
				b.WriteString(strings.TrimSuffix(tool, "-save") + " " + table + " " + l + "\n")
			}
		}
	}
	return b.String()
}

var ctzoneTestListen = netip.MustParseAddrPort("127.0.0.1:15053")

func lifecycleConfig(backend string) Config {
	return Config{
		ListenAddr:  netip.MustParseAddrPort("169.254.20.53:53"),
		ListenAddr6: netip.MustParseAddrPort("[fd00:20::53]:53"),
		Nameservers: []netip.Addr{
			netip.MustParseAddr("169.254.53.1"),
			netip.MustParseAddr("fd00:53::1"),
			netip.MustParseAddr("127.0.0.53"), // loopback: never captured
		},
		ProxyUIDs:     []uint32{1337},
		ProxyGIDs:     []uint32{1337},
		Backend:       backend,
		CheckInterval: 100 * time.Millisecond,
	}
}

func installIn(t *testing.T, ns *testenv.Netns, cfg Config) (*Rules, error) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	var r *Rules
	err := ns.Do(func() (err error) { r, err = install(cfg); return err })
	return r, err
}

// install is New and Start; on a Start error nothing is left to close.
func install(cfg Config) (*Rules, error) {
	r, err := New(cfg)
	if err != nil {
		return nil, err
	}
	if err := r.Start(context.Background()); err != nil {
		return nil, errors.Join(err, r.Close())
	}
	return r, nil
}

// crash stops r's repair loop and leaves its rules installed, as a crash does.
func crash(t *testing.T, r *Rules) {
	t.Helper()
	r.Handoff()
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

func mustInstall(t *testing.T, ns *testenv.Netns, cfg Config) *Rules {
	t.Helper()
	r, err := installIn(t, ns, cfg)
	if err != nil {
		t.Fatalf("install: %v", err)
	}
	return r
}

func cleanupIn(t *testing.T, ns *testenv.Netns, backend string) []string {
	t.Helper()
	var removed []string
	if err := ns.Do(func() (err error) { removed, err = Cleanup(backend); return err }); err != nil {
		t.Fatalf("Cleanup(%q): %v (removed %q)", backend, err, removed)
	}
	return removed
}

// TestLifecycle: Install is idempotent, Run repairs drift, Close removes all,
// Cleanup removes what a crashed agent left, and Install works on leftovers;
// for each backend, in a namespace of the test's own.
func TestLifecycle(t *testing.T) {
	for _, backend := range []string{BackendNFT, BackendLegacy} {
		t.Run(backend, func(t *testing.T) {
			testenv.RequirePrivileged(t, "ip", "iptables-"+backend, "ip6tables-"+backend)
			ns := testenv.NewNetns(t, "mdct-life")
			cfg := lifecycleConfig(backend)
			r, first := installIsIdempotent(t, ns, cfg, backend)
			repairLoopRepairs(t, ns, backend, first)
			closeRemovesAll(t, ns, backend, r)
			cleanupRemovesACrashedInstall(t, ns, cfg, backend)
			installWorksOnLeftovers(t, ns, cfg, backend, first)
		})
	}
}

// installIsIdempotent installs twice: the same rule set, with the expected
// rules; the first, handed off and closed, removes nothing. It returns the
// second rule set and the rules.
func installIsIdempotent(t *testing.T, ns *testenv.Netns, cfg Config, backend string) (*Rules, string) {
	t.Helper()
	// Idempotent: twice gives the same rule set, with the expected rules.
	crashed := mustInstall(t, ns, cfg)
	first := saveOurs(t, ns.Name, backend, true)
	t.Logf("installed:\n%s", first)
	for _, want := range []string{
		"iptables-%s *nat -A OUTPUT -m comment --comment meshdns-ebpf -j MESHDNS-OUTPUT",
		"iptables-%s *nat -A PREROUTING -m comment --comment meshdns-ebpf -j MESHDNS-PREROUTING",
		"iptables-%s *nat -A MESHDNS-OUTPUT -m owner --uid-owner 1337 -j RETURN",
		"iptables-%s *nat -A MESHDNS-OUTPUT -d 169.254.53.1/32 -p udp -m udp --dport 53 -j DNAT --to-destination 169.254.20.53:53",
		"iptables-%s *nat -A MESHDNS-PREROUTING -d 169.254.53.1/32 -p tcp -m tcp --dport 53 -j DNAT --to-destination 169.254.20.53:53",
		"iptables-%s *raw -A MESHDNS-OUTPUT -s 169.254.20.53/32 -p udp -m udp --sport 53 -j CT --zone 16211",
		"iptables-%s *raw -A MESHDNS-PREROUTING -d 169.254.53.1/32 -p udp -m udp --dport 53 -j CT --zone 16211",
		"ip6tables-%s *nat -A MESHDNS-OUTPUT -d fd00:53::1/128 -p udp -m udp --dport 53 -j DNAT --to-destination [fd00:20::53]:54",
		"ip6tables-%s *raw -A MESHDNS-OUTPUT -s fd00:20::53/128 -p udp -m udp --sport 53:54 -j CT --zone 16211",
	} {
		if want = fmt.Sprintf(want, backend); !strings.Contains(first, want+"\n") {
			t.Errorf("installed rules lack %q", want)
		}
	}
	if strings.Contains(first, "127.0.0.53") {
		t.Errorf("a loopback nameserver is captured:\n%s", first)
	}
	r := mustInstall(t, ns, cfg)
	if again := saveOurs(t, ns.Name, backend, true); again != first {
		t.Fatalf("second Install changed the rules:\nfirst:\n%s\nsecond:\n%s", first, again)
	}
	// The first rule set was left to the second (as after a crash or a
	// handover): it stops checking and removes nothing.
	crashed.Handoff()
	if err := crashed.Close(); err != nil {
		t.Fatal(err)
	}
	if again := saveOurs(t, ns.Name, backend, true); again != first {
		t.Fatalf("closing the handed-off rule set changed the rules:\n%s", again)
	}
	return r, first
}

// repairLoopRepairs damages the rules; the repair loop puts them back.
func repairLoopRepairs(t *testing.T, ns *testenv.Netns, backend, first string) {
	t.Helper()
	// The repair loop repairs: a deleted jump, a deleted rule, a foreign
	// rule placed before our jump.
	ipt := "iptables-" + backend
	ns.Exec(t, ipt, "-w", "-t", "nat", "-D", "OUTPUT", "-m", "comment", "--comment", commentTag, "-j", chainOutput)
	ns.Exec(t, ipt, "-w", "-t", "raw", "-D", chainOutput, "3")
	ns.Exec(t, ipt, "-w", "-t", "nat", "-I", "PREROUTING", "1", "-p", "tcp", "--dport", "9", "-j", "RETURN")
	ns.Exec(t, "ip6"+strings.TrimPrefix(ipt, "ip"), "-w", "-t", "raw", "-F", chainPrerouting)
	if saveOurs(t, ns.Name, backend, true) == first {
		t.Fatal("the rules did not change: the repair test tests nothing")
	}
	repaired := testenv.WaitFor(5*time.Second, func() bool {
		pre := ns.Exec(t, ipt, "-w", "-t", "nat", "-S", "PREROUTING")
		return saveOurs(t, ns.Name, backend, true) == first &&
			strings.Contains(strings.Split(pre, "\n")[1], "-j "+chainPrerouting)
	})
	if !repaired {
		t.Fatalf("Run did not repair the rules:\nwant:\n%s\ngot:\n%s%s", first, saveOurs(t, ns.Name, backend, true),
			ns.Exec(t, ipt, "-w", "-t", "nat", "-S", "PREROUTING"))
	}
}

// closeRemovesAll: Close leaves nothing of ours, and a second Close is fine.
func closeRemovesAll(t *testing.T, ns *testenv.Netns, backend string, r *Rules) {
	t.Helper()
	// Close leaves nothing of ours in either family.
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if left := saveOurs(t, ns.Name, backend, true); left != "" {
		t.Fatalf("Close left:\n%s", left)
	}
	if err := r.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// cleanupRemovesACrashedInstall: Install, no Close; Cleanup removes it all,
// twice is a no-op.
func cleanupRemovesACrashedInstall(t *testing.T, ns *testenv.Netns, cfg Config, backend string) {
	t.Helper()
	// Crash: Install, no Close; Cleanup removes it all, twice is a no-op.
	crash(t, mustInstall(t, ns, cfg))
	removed := cleanupIn(t, ns, backend)
	t.Logf("Cleanup removed:\n%s", strings.Join(removed, "\n"))
	if len(removed) == 0 {
		t.Error("Cleanup after a crash removed nothing")
	}
	if left := saveOurs(t, ns.Name, backend, true); left != "" {
		t.Fatalf("Cleanup left:\n%s", left)
	}
	if removed := cleanupIn(t, ns, ""); len(removed) != 0 {
		t.Errorf("Cleanup on a clean namespace removed %q", removed)
	}
}

// installWorksOnLeftovers installs on top of a crash's damaged leftovers.
func installWorksOnLeftovers(t *testing.T, ns *testenv.Netns, cfg Config, backend, first string) {
	t.Helper()
	ipt := "iptables-" + backend
	// Install on top of (damaged) leftovers of a crash.
	crash(t, mustInstall(t, ns, cfg))
	ns.Exec(t, ipt, "-w", "-t", "nat", "-A", "OUTPUT", "-m", "comment", "--comment", commentTag, "-j", chainOutput)
	ns.Exec(t, ipt, "-w", "-t", "nat", "-D", chainOutput, "1")
	ns.Exec(t, ipt, "-w", "-t", "raw", "-N", chainPrefix+"OLD")
	ns.Exec(t, ipt, "-w", "-t", "raw", "-I", "OUTPUT", "1", "-j", chainPrefix+"OLD")
	r := mustInstall(t, ns, cfg)
	if got := saveOurs(t, ns.Name, backend, true); got != first {
		t.Fatalf("Install on leftovers:\nwant:\n%s\ngot:\n%s", first, got)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if left := saveOurs(t, ns.Name, backend, true); left != "" {
		t.Fatalf("Close left:\n%s", left)
	}
}

// TestInstallFailureRemovesAll: an Install that fails half-way (here: after the
// v4 nat table) leaves no rule or chain of ours.
func TestInstallFailureRemovesAll(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "iptables-nft")
	ns := testenv.NewNetns(t, "mdct-fail")
	testHookApplied = func(v6 bool, table string) error {
		if table == "nat" {
			return errors.New("injected failure")
		}
		return nil
	}
	defer func() { testHookApplied = nil }()
	_, err := installIn(t, ns, lifecycleConfig(BackendNFT))
	if err == nil || !strings.Contains(err.Error(), "injected failure") {
		t.Fatalf("Install: %v, want the injected failure", err)
	}
	if left := saveOurs(t, ns.Name, BackendNFT, true); left != "" {
		t.Fatalf("failed Install left:\n%s", left)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no listen", Config{Nameservers: []netip.Addr{netip.MustParseAddr("10.0.0.10")}}, "listen address"},
		{"nothing", Config{ListenAddr: netip.MustParseAddrPort("127.0.0.1:15053")}, "nothing to capture"},
		{"only loopback", Config{ListenAddr: netip.MustParseAddrPort("127.0.0.1:15053"), Nameservers: []netip.Addr{netip.MustParseAddr("127.0.0.53")}}, "nothing to capture"},
		{"v6 without v6 listen", Config{ListenAddr: netip.MustParseAddrPort("169.254.20.53:53"), Nameservers: []netip.Addr{netip.MustParseAddr("fd00::53")}}, "ListenAddr6"},
		{"listen is nameserver", Config{ListenAddr: netip.MustParseAddrPort("169.254.20.53:53"), Nameservers: []netip.Addr{netip.MustParseAddr("169.254.20.53")}}, "listen address itself"},
		{"backend", Config{ListenAddr: netip.MustParseAddrPort("127.0.0.1:15053"), CaptureAll: true, Backend: "ebtables"}, "backend"},
		{"slot overflow", Config{ListenAddr: netip.MustParseAddrPort("127.0.0.1:65535"), Nameservers: []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")}}, "out of range"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// normalize fails before any namespace is touched.
			_, err := install(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Install: %v, want an error about %q", err, tc.want)
			}
		})
	}
}
