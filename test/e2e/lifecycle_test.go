package e2e

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

const sigterm = syscall.SIGTERM

// hookCounter reads one counter of one hook from `stats -o json`.
// hook "total" is the sum over the hooks.
func hookCounter(t *testing.T, n *node, hook, counter string) uint64 {
	t.Helper()
	s := n.statsJSON()
	hooks, _ := s["hooks"].([]any)
	if hook == "total" {
		hooks = []any{s["total"]}
	}
	for _, h := range hooks {
		m, _ := h.(map[string]any)
		if m["hook"] == hook || hook == "total" {
			v, ok := m[counter].(float64)
			if !ok {
				t.Fatalf("stats -o json: hook %s has no counter %q: %v", hook, counter, m)
			}
			return uint64(v)
		}
	}
	t.Fatalf("stats -o json has no hook %q: %v", hook, s)
	return 0
}

// timeToOriginal polls a client until the original nameserver answers the mesh name
// (NXDOMAIN) and returns how long that took from start.
func timeToOriginal(t *testing.T, n *node, start time.Time) time.Duration {
	t.Helper()
	var qstart time.Time
	if !testenv.Poll(time.Until(start.Add(10*time.Second)), 50*time.Millisecond, func() bool {
		qstart = time.Now()
		out, _ := n.client(n.ns, 1000, "dig", "+time=1", "+tries=1", meshName)
		return strings.Contains(out, "status: NXDOMAIN")
	}) {
		t.Fatalf("clients never reached the original nameserver again")
	}
	// The query that saw the original nameserver was sent at qstart.
	return qstart.Sub(start)
}

// TestFailOpen: after SIGTERM and after kill -9, clients
// resolve through the original nameserver at once; SIGTERM leaves the programs
// attached but inert for the next agent (nothing with --persist=false); cleanup
// removes what kill -9 left; a new agent starts on top of those leftovers.
func TestFailOpen(t *testing.T) {
	n := newNode(t)
	n.start("ebpf")

	start := time.Now()
	if err := n.signal(syscall.SIGTERM); err != nil {
		t.Fatalf("agent exit after SIGTERM: %v\n%s", err, n.stderr.String())
	}
	if d := timeToOriginal(t, n, start); d > time.Second {
		t.Errorf("after SIGTERM clients reached the original nameserver after %v, want within 1s", d)
	} else {
		t.Logf("after SIGTERM: original nameserver answers after %v", d)
	}
	n.assertStopped()

	n.start("ebpf")
	start = time.Now()
	_ = n.signal(syscall.SIGKILL)
	d := timeToOriginal(t, n, start)
	if d > time.Second {
		t.Errorf("after kill -9 clients reached the original nameserver after %v, want within 1s", d)
	} else {
		t.Logf("after kill -9: original nameserver answers after %v", d)
	}
	if len(n.attached()) == 0 || len(n.pins()) == 0 {
		t.Fatalf("kill -9 left nothing pinned; the cleanup check below would prove nothing")
	}
	// A new agent starts on top of the leftovers, then stops cleanly and
	// completely with --persist=false.
	n.start("ebpf", "--persist=false")
	if err := n.signal(syscall.SIGTERM); err != nil {
		t.Fatalf("agent exit: %v\n%s", err, n.stderr.String())
	}
	n.assertClean()

	// kill -9 again, then `cleanup` removes everything.
	n.start("ebpf")
	_ = n.signal(syscall.SIGKILL)
	out, err := n.cli("cleanup", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out)
	}
	if !strings.Contains(out, "removed") {
		t.Errorf("cleanup said nothing about what it removed:\n%s", out)
	}
	n.assertClean()
}

// TestStatsCountExactly: N queries → N redirects on the expected hook,
// in the table and in JSON, and the per-cgroup view names the test cgroup.
func TestStatsCountExactly(t *testing.T) {
	n := newNode(t)
	n.start("ebpf")
	const N = 100
	cases := []struct {
		name, hook, counter string
		args                []string
	}{
		{"connected-udp", "connect4", "redirected_udp", nil},
		{"unconnected-udp", "sendmsg4", "redirected_udp", []string{"-unconnected"}},
		{"tcp", "connect4", "redirected_tcp", []string{"-tcp"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := hookCounter(t, n, c.hook, c.counter)
			args := append([]string{"-n", strconv.Itoa(N), "-server", origNS + ":53"}, c.args...)
			out, err := n.client(n.ns, 1000, bins.dnsblast, append(args, meshName)...)
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.TrimSpace(out); got != fmt.Sprintf("%d %s", N, meshIP) {
				t.Fatalf("dnsblast: %q, want %d answers of %s", got, N, meshIP)
			}
			if got := hookCounter(t, n, c.hook, c.counter) - before; got != N {
				t.Errorf("%s %s grew by %d for %d queries", c.hook, c.counter, got, N)
			}
		})
	}
	table, err := n.cli("stats", "--bpffs", n.bpffs)
	if err != nil {
		t.Fatalf("stats: %v\n%s", err, table)
	}
	lines := strings.Split(table, "\n")
	if !strings.HasPrefix(lines[0], "HOOK") {
		t.Errorf("stats table does not start with an UPPERCASE header:\n%s", table)
	}
	want := fmt.Sprint(hookCounter(t, n, "sendmsg4", "redirected_udp"))
	found := false
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "sendmsg4" {
			found = strings.Contains(" "+strings.Join(f[1:], " ")+" ", " "+want+" ")
		}
	}
	if !found {
		t.Errorf("stats table has no sendmsg4 row with %s:\n%s", want, table)
	}
	rel := strings.TrimPrefix(n.cg.Path, filepath.Dir(n.cg.Path))
	if !strings.Contains(table, rel) {
		t.Errorf("stats table does not show the cgroup %s:\n%s", n.cg.Path, table)
	}
	if code, body := n.httpGet("http://" + adminAddr + "/readyz"); code != 200 {
		t.Errorf("/readyz: %d %s", code, body)
	}
	if code, body := n.httpGet("http://" + adminAddr + "/healthz"); code != 200 {
		t.Errorf("/healthz: %d %s", code, body)
	}
	code, metrics := n.httpGet("http://" + adminAddr + "/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{
		`meshdns_dns_requests_total{proto="udp",qtype="A"}`,
		`meshdns_datapath_events_total{counter="redirected_udp",hook="sendmsg4"} ` + want,
		`meshdns_nametable_hosts 2`,
		`meshdns_upstream_healthy{upstream="` + origNS + `:53"} 1`,
		`meshdns_cache_entries`,
		`meshdns_build_info`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	status, err := n.cli("status", "--bpffs", n.bpffs, "--state-dir", n.stateDir)
	if err != nil {
		t.Fatalf("status: %v\n%s", err, status)
	}
	for _, w := range []string{"ebpf", listen4, "connect4", "bpffs mount", filepath.Dir(n.bpffs) + " (bpf, "} {
		if !strings.Contains(status, w) {
			t.Errorf("status lacks %q:\n%s", w, status)
		}
	}
}

// TestBadInput: each bad input gets a clear error and a non-zero
// exit, and leaves nothing attached, pinned or added.
func TestBadInput(t *testing.T) {
	n := newNode(t)
	for _, c := range badInputCases(t) {
		t.Run(c.name, func(t *testing.T) { n.checkBadInput(t, c) })
	}
}

// badCase is one bad input to the agent and what its error must say.
type badCase struct {
	name string
	uid  int
	args []string
	want string
	caps []string // nil: the mode's (testenv.ModeCaps)
}

// badInputCases are TestBadInput's inputs; the cgroup v1 one only where a
// v1 hierarchy is mounted.
func badInputCases(t *testing.T) []badCase {
	badTable := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(badTable, []byte("table:\n  x.example:\n    ips: [\"not-an-ip\"]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []badCase{
		{"not-root", 1000, nil, "needs CAP_BPF (load the eBPF programs and create their maps) and CAP_NET_ADMIN", nil},
		// The capability errors the DaemonSet docs quote.
		{"no-cap-bpf", 0, nil, "meshdns-ebpf run --mode ebpf needs CAP_BPF (load the eBPF programs and create their maps); it runs as uid 0 with CAP_NET_ADMIN, CAP_NET_BIND_SERVICE", []string{"net_admin", "net_bind_service"}},
		{"no-cap-net-admin", 0, nil, "needs CAP_NET_ADMIN (attach to cgroups, register the resolver's sockets, SO_MARK, the dummy link and its address)", []string{"bpf", "net_bind_service"}},
		{"no-cap-net-bind-service", 0, nil, "needs CAP_NET_BIND_SERVICE (listen on a port below 1024)", []string{"bpf", "net_admin"}},
		{"iptables-no-cap-net-raw", 0, []string{"--mode", "iptables"}, "meshdns-ebpf run --mode iptables needs CAP_NET_RAW (the legacy iptables backend (its tools open a raw socket); not needed with --iptables-backend nft)", []string{"net_admin", "net_bind_service"}},
		{"cgroup-missing", 0, []string{"--cgroup", "/sys/fs/cgroup/no-such-meshdns-group"}, "cgroup directory /sys/fs/cgroup/no-such-meshdns-group does not exist", nil},
		{"names-unreadable", 0, []string{"--names", badTable}, "not-an-ip", nil},
		{"listen-in-use", 0, nil, "address already in use", nil},
		{"kernel-lacks-hook", 0, []string{"--x-force-no-ebpf", "cgroup/recvmsg4 not supported"}, "cannot work here", nil},
		{"bad-mode", 0, []string{"--mode", "magic"}, "--mode", nil},
		{"bad-listen", 0, []string{"--listen", "169.254.20.53"}, "ADDR:PORT", nil},
	}
	if v1dir := cgroupV1Dir(); v1dir != "" {
		cases = append(cases, badCase{"cgroup-v1", 0, []string{"--cgroup", v1dir}, "not on a cgroup2 filesystem", nil})
	}
	cases = append(cases, badCase{"no-cgroup2-mount", 0, nil, "no cgroup2 filesystem is mounted", nil})
	return cases
}

// cgroupV1Dir is a cgroup v1 hierarchy's directory, or "".
func cgroupV1Dir() string {
	v1, _ := filepath.Glob("/sys/fs/cgroup/*")
	for _, d := range v1 {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() && !isCgroup2(d) {
			return d
		}
	}
	return ""
}

// checkBadInput runs the agent on c's input: it must exit non-zero, say
// c.want, and leave nothing attached, pinned or added.
func (n *node) checkBadInput(t *testing.T, c badCase) {
	if c.name == "listen-in-use" {
		n.occupyListen(t)
	}
	args := n.agentArgs("ebpf", c.args...) // a repeated flag overrides the earlier one
	caps := c.caps
	if caps == nil && c.uid == 0 {
		caps = testenv.ModeCaps["ebpf"]
	}
	cmd := testenv.Command(t.Context(), testenv.Proc{Netns: n.ns, Cgroup: n.cg, UID: c.uid, GID: c.uid, NetOnly: true, Caps: caps}, bins.agent, args...)
	if c.name == "no-cgroup2-mount" {
		cmd = n.withoutCgroup2Mount(t, args)
	}
	p := agenttest.Start(t, cmd, agenttest.Options{Unmanaged: true})
	ok, err := p.Wait(20 * time.Second)
	if !ok {
		p.Kill()
		t.Fatalf("agent kept running on bad input %v:\n%s", c.args, p.Log)
	}
	out := p.Log.String()
	if err == nil {
		t.Fatalf("agent exited 0 on bad input %v:\n%s", c.args, out)
	}
	if !strings.Contains(out, c.want) {
		t.Errorf("error does not say %q:\n%s", c.want, out)
	}
	if a := n.attached(); len(a) > 0 {
		t.Errorf("programs left attached: %v", a)
	}
	if p := n.pins(); len(p) > 0 {
		t.Errorf("pins left: %v", p)
	}
	if c.name != "listen-in-use" {
		if out := n.ns.IP(t, "addr", "show", "dev", "lo"); strings.Contains(out, listen4) {
			t.Errorf("node address left behind:\n%s", out)
		}
	}
}

// occupyListen holds the resolver's TCP port on its address inside the node
// until the test ends.
func (n *node) occupyListen(t *testing.T) {
	n.ns.IP(t, "addr", "add", listen4+"/32", "dev", "lo")
	t.Cleanup(func() { n.ns.IP(t, "addr", "del", listen4+"/32", "dev", "lo") })
	var l net.Listener
	if err := n.ns.Do(func() (err error) { l, err = net.Listen("tcp", listen4+":53"); return }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

// withoutCgroup2Mount is the agent without --cgroup, in a private mount
// namespace without the cgroup2 mount. The guard refuses to start the agent
// if the mount is still visible: it would then attach to the machine's root
// cgroup.
func (n *node) withoutCgroup2Mount(t *testing.T, args []string) *exec.Cmd {
	mnt, err := cgroup2.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	script := `umount -l "$1" && ! grep -q ' cgroup2 ' /proc/self/mounts || exit 99; shift; exec "$@"`
	inner := append(append(testenv.OnlyCaps(testenv.ModeCaps["ebpf"]), bins.agent), withoutFlag(args, "--cgroup")...)
	return testenv.Command(t.Context(), testenv.Proc{Netns: n.ns, Cgroup: n.cg, NetOnly: true},
		"unshare", append([]string{"--mount", "--propagation", "private", "sh", "-c", script, "sh", mnt}, inner...)...)
}

// withoutFlag drops "name value" from args.
func withoutFlag(args []string, name string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		if args[i] == name {
			i++
			continue
		}
		out = append(out, args[i])
	}
	return out
}

func isCgroup2(dir string) bool {
	var st syscall.Statfs_t
	return syscall.Statfs(dir, &st) == nil && st.Type == 0x63677270
}
