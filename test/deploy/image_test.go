package deploy

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"
	corev1 "k8s.io/api/core/v1"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The two clean-checkout builds, made once for every test of the package.
var shared struct {
	once   sync.Once
	dir    string
	builds [2]*imageBuild
	err    error
	stale  string // why the committed Debian lock could not be used ("" when it could)
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.dir != "" {
		_ = os.RemoveAll(shared.dir)
	}
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// builds returns the two builds of HEAD, from two checkouts in two directories.
func builds(t *testing.T) [2]*imageBuild {
	t.Helper()
	for _, tool := range []string{"git", "make", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Skip(t, "building the image needs %s on PATH: %v", tool, err)
		}
	}
	shared.once.Do(func() {
		root := repoRoot()
		in, err := headInputs(root)
		if err != nil {
			shared.err = err
			return
		}
		if shared.dir, err = os.MkdirTemp("", "meshdns-image-"); err != nil {
			shared.err = err
			return
		}
		if shared.stale, err = ensureDebs(root, shared.dir, &in); err != nil {
			shared.err = err
			return
		}
		for i := range shared.builds {
			b, err := buildFromCleanCheckout(root, filepath.Join(shared.dir, fmt.Sprint(i)), in)
			shared.builds[i] = b
			if err != nil {
				shared.err = err
				return
			}
		}
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	if shared.stale != "" {
		t.Logf("WARNING: deploy/image/debs.lock is stale (%s); built with a fresh lock of what Debian serves today. Run make image-lock and commit the lock.", shared.stale)
	}
	return shared.builds
}

func TestImageReproducible(t *testing.T) {
	b := builds(t)
	if b[0].digest == "" || !strings.HasPrefix(b[0].digest, "sha256:") {
		t.Fatalf("build 1 wrote digest %q", b[0].digest)
	}
	if b[0].digest != b[1].digest {
		t.Fatalf("two builds of the same commit differ:\n  %s (%s)\n  %s (%s)", b[0].digest, b[0].checkout, b[1].digest, b[1].checkout)
	}
	for _, f := range []string{"meshdns-ebpf.oci.tar", "oci/index.json"} {
		x, err := os.ReadFile(filepath.Join(b[0].out, f))
		if err != nil {
			t.Fatal(err)
		}
		y, err := os.ReadFile(filepath.Join(b[1].out, f))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(x, y) {
			t.Errorf("%s differs between the two builds", f)
		}
	}
	fi, err := os.Stat(filepath.Join(b[0].out, "meshdns-ebpf.oci.tar"))
	if err != nil {
		t.Fatal(err)
	}
	summary := fmt.Sprintf("image: %s, two clean builds identical (%.1fs, %.1fs), archive %.1f MiB\n%s",
		b[0].digest, b[0].took.Seconds(), b[1].took.Seconds(), float64(fi.Size())/(1<<20), sizeTable(b[0].log))
	t.Log(summary)
	// `make test` prints this after the suite (go test hides a passing test's log).
	if err := os.MkdirAll(filepath.Join(repoRoot(), "out"), 0o755); err == nil {
		_ = os.WriteFile(filepath.Join(repoRoot(), "out", "image-test.txt"), []byte(summary), 0o644)
	}
}

// sizeTable is the per-platform table `image build` printed.
func sizeTable(log string) string {
	var keep []string
	in := false
	for _, l := range strings.Split(log, "\n") {
		if strings.HasPrefix(l, "ARCH ") {
			in = true
		}
		if in && strings.TrimSpace(l) != "" && !strings.HasPrefix(l, "wrote ") && !strings.HasPrefix(l, "make") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "\n")
}

// rootfs unpacks the image for this machine's architecture, once per test.
func rootfs(t *testing.T) (string, ociConfig) {
	t.Helper()
	b := builds(t)
	l := layout{dir: filepath.Join(b[0].out, "oci")}
	m, c, err := l.platformImage(goruntime.GOARCH)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil { // the image's non-root user must reach it
		t.Fatal(err)
	}
	err = l.unpack(m, c, dir, func(h *tar.Header) error {
		if h.Uid != 0 || h.Gid != 0 {
			return fmt.Errorf("%s is owned by %d:%d, want 0:0", h.Name, h.Uid, h.Gid)
		}
		if h.Mode&0o6000 != 0 {
			return fmt.Errorf("%s is setuid or setgid (mode %o)", h.Name, h.Mode)
		}
		for k := range h.PAXRecords {
			if strings.HasPrefix(k, "SCHILY.xattr.") {
				return fmt.Errorf("%s carries an extended attribute %s (file capabilities?)", h.Name, k)
			}
		}
		if !h.ModTime.Equal(time.Unix(h.ModTime.Unix(), 0)) || h.ModTime.IsZero() {
			return fmt.Errorf("%s: modification time %v", h.Name, h.ModTime)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return dir, c
}

// inImage runs a command of the image chrooted into root, as uid:gid.
func inImage(root string, uid, gid uint32, name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	cmd.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root, Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestImageRuns(t *testing.T) {
	testenv.RequirePrivileged(t)
	root, cfg := rootfs(t)
	if cfg.OS != "linux" || cfg.Architecture != goruntime.GOARCH {
		t.Errorf("config platform %s/%s", cfg.OS, cfg.Architecture)
	}
	if cfg.Config.User != "65532:65532" {
		t.Errorf("image user %q: want the non-root 65532:65532", cfg.Config.User)
	}
	if want := []string{"/usr/local/bin/meshdns-ebpf"}; strings.Join(cfg.Config.Entrypoint, " ") != want[0] {
		t.Errorf("entrypoint %v, want %v", cfg.Config.Entrypoint, want)
	}
	in, err := headInputs(repoRoot())
	if err != nil {
		t.Fatal(err)
	}
	// As the image's own user, as a container without capabilities would.
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"/usr/local/bin/meshdns-ebpf", "version"}, []string{"meshdns-ebpf " + in.version + " (go"}},
		{[]string{"/usr/local/bin/meshdns-ebpf", "run", "--help"}, []string{"Usage of meshdns-ebpf run", "-mode", "-listen", "-kubernetes", "-node-name"}},
		{[]string{"iptables", "--version"}, []string{"iptables v1.8.9 (nf_tables)"}},
		{[]string{"ip6tables-save", "--version"}, []string{"ip6tables-save v1.8.9 (nf_tables)"}},
		{[]string{"iptables-legacy", "--version"}, []string{"iptables v1.8.9 (legacy)"}},
		{[]string{"ip6tables-legacy-restore", "--version"}, []string{"ip6tables-restore v1.8.9 (legacy)"}},
	} {
		out, err := inImage(root, 65532, 65532, tc.args[0], tc.args[1:]...)
		if err != nil {
			t.Errorf("%v: %v\n%s", tc.args, err, out)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("%v printed %q, want it to contain %q", tc.args, out, w)
			}
		}
	}
}

// The rules the agent installs in iptables mode (docs/iptables-mode.md), with
// every match and target it uses, restored and read back with the image's own
// iptables, both backends, both families, in a network namespace of its own.
func TestImageIptablesRules(t *testing.T) {
	testenv.RequirePrivileged(t, "unshare", "sh", "mount")
	root, _ := rootfs(t)
	rules := map[string]string{
		"iptables": `*raw
:MESHDNS-OUTPUT - [0:0]
-A OUTPUT -m comment --comment meshdns-ebpf -j MESHDNS-OUTPUT
-A MESHDNS-OUTPUT -d 169.254.20.53/32 -p udp -m udp --dport 53:55 -j CT --zone 16211
-A MESHDNS-OUTPUT -s 169.254.20.53/32 -p udp -m udp --sport 53:55 -j CT --zone 16211
-A MESHDNS-OUTPUT -m mark --mark 0x3f53 -j RETURN
-A MESHDNS-OUTPUT -m owner --uid-owner 1337 -j RETURN
-A MESHDNS-OUTPUT -m owner --gid-owner 1337 -j RETURN
COMMIT
*nat
:MESHDNS-OUTPUT - [0:0]
:MESHDNS-PREROUTING - [0:0]
-A PREROUTING -m comment --comment meshdns-ebpf -j MESHDNS-PREROUTING
-A OUTPUT -m comment --comment meshdns-ebpf -j MESHDNS-OUTPUT
-A MESHDNS-OUTPUT -d 10.96.0.10/32 -p udp -m udp --dport 53 -j DNAT --to-destination 169.254.20.53:53
-A MESHDNS-OUTPUT -d 10.96.0.10/32 -p tcp -m tcp --dport 53 -j DNAT --to-destination 169.254.20.53:53
-A MESHDNS-OUTPUT -d 127.0.0.0/8 -j RETURN
-A MESHDNS-PREROUTING -d 169.254.20.53/32 -j RETURN
COMMIT
`,
		"ip6tables": `*raw
:MESHDNS-OUTPUT - [0:0]
-A OUTPUT -m comment --comment meshdns-ebpf -j MESHDNS-OUTPUT
-A MESHDNS-OUTPUT -d fd00:20::53/128 -p udp -m udp --dport 53:55 -j CT --zone 16211
-A MESHDNS-OUTPUT -m mark --mark 0x3f53 -j RETURN
COMMIT
*nat
:MESHDNS-OUTPUT - [0:0]
-A OUTPUT -m comment --comment meshdns-ebpf -j MESHDNS-OUTPUT
-A MESHDNS-OUTPUT -d fd00:10::a/128 -p udp -m udp --dport 53 -j DNAT --to-destination [fd00:20::53]:53
COMMIT
`,
	}
	for _, backend := range []string{"nft", "legacy"} {
		for _, fam := range []string{"iptables", "ip6tables"} {
			t.Run(backend+"/"+fam, func(t *testing.T) {
				if err := os.WriteFile(filepath.Join(root, "tmp", "rules"), []byte(rules[fam]), 0o644); err != nil {
					t.Fatal(err)
				}
				// A new network and mount namespace: /proc for iptables-legacy-save,
				// nothing the host's tables can see. Both end with the shell.
				script := `mount -t proc proc "$1/proc" && chroot "$1" /usr/sbin/$2-restore --noflush --wait <"$1/tmp/rules" && chroot "$1" /usr/sbin/$2-save`
				out, err := exec.Command("unshare", "--net", "--mount", "--propagation", "private", "--",
					"sh", "-c", script, "sh", root, fam+"-"+backend).CombinedOutput()
				if err != nil {
					t.Fatalf("%v\n%s", err, out)
				}
				for _, l := range strings.Split(rules[fam], "\n") {
					if strings.HasPrefix(l, "-A ") && !strings.Contains(string(out), l) {
						t.Errorf("rule %q not read back by %s-%s-save:\n%s", l, fam, backend, out)
					}
				}
			})
		}
	}
}

// The agent of the image, chrooted into it, in iptables mode in a network
// namespace of its own: it detects the backend and installs its rules with the
// image's iptables, answers captured queries (name table and forwarded), and
// removes everything on SIGTERM.
func TestImageIptablesFallback(t *testing.T) {
	testenv.RequirePrivileged(t, "unshare", "sh", "mount", "nsenter", "ip", "iptables-nft-save")
	root, _ := rootfs(t)
	ns := testenv.NewNetns(t, "img")
	// The cluster DNS address must be routable for a client to send to it.
	ns.IP(t, "route", "add", "10.96.0.0/16", "dev", "lo")
	up := testenv.StartFakeDNS(t, ns, "127.0.0.1:0", map[string][]netip.Addr{"example.test.": {netip.MustParseAddr("192.0.2.7")}})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// What a container runtime gives a container: /proc and /dev.
	script := `mount -t proc proc "$0/proc" && mount --bind /dev "$0/dev" && exec chroot "$0" /usr/local/bin/meshdns-ebpf "$@"`
	cmd := exec.CommandContext(ctx, "nsenter", "--net="+ns.Path(), "--", "unshare", "--mount", "--propagation", "private", "--",
		"sh", "-c", script, root, "run", "--mode=iptables", "--nameservers=10.96.0.10", "--upstream="+up.Addr,
		"--admin=127.0.0.1:9153", "--state-dir=/run/meshdns", "--log-level=debug")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGKILL) }
	proc := agenttest.Start(t, cmd, agenttest.Options{Group: true})
	log := proc.Log

	ready := testenv.WaitFor(20*time.Second, func() bool { return proc.Exited() || readyzIn(ns, "127.0.0.1:9153") })
	if !ready || proc.Exited() {
		_, err := proc.Wait(0)
		t.Fatalf("the agent in the image did not become ready (exit: %v):\n%s", err, log.String())
	}
	checkShippedProbes(t, proc.Pid())
	for name, want := range map[string]string{
		"productpage.default.svc.cluster.local": "240.240.0.10", // the embedded name table
		"example.test":                          "192.0.2.7",    // forwarded upstream
	} {
		r, err := queryIn(ns, name, "10.96.0.10:53")
		if err != nil {
			t.Fatalf("query %s to the captured 10.96.0.10: %v\nagent log:\n%s", name, err, log.String())
		}
		if len(r.Answer) != 1 || !strings.Contains(r.Answer[0].String(), want) {
			t.Errorf("%s: answer %v, want %s", name, r.Answer, want)
		}
	}
	if n := up.Count("example.test."); n == 0 {
		t.Error("the upstream never saw the forwarded query")
	}
	if n := up.Count("productpage.default.svc.cluster.local."); n != 0 {
		t.Errorf("the upstream saw %d queries for a name-table name", n)
	}
	saved := ns.Exec(t, "iptables-nft-save")
	if !strings.Contains(saved, "-j DNAT --to-destination 169.254.20.53:53") {
		t.Errorf("no DNAT rule of the agent in the namespace:\n%s", saved)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if ok, err := proc.Wait(15 * time.Second); !ok {
		t.Fatalf("agent did not stop on SIGTERM:\n%s", log.String())
	} else if err != nil {
		t.Fatalf("agent exited with %v on SIGTERM:\n%s", err, log.String())
	}
	if saved := ns.Exec(t, "iptables-nft-save"); strings.Contains(saved, "MESHDNS") {
		t.Errorf("rules left after a clean stop:\n%s", saved)
	}
	if _, err := os.Stat(filepath.Join(root, "run", "meshdns", "agent.json")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("state file left after a clean stop: %v", err)
	}
}

// readyzIn reports whether GET /readyz of addr, from inside ns, is 200. It
// dials on the thread inside the namespace (http.Client would dial from
// another goroutine, outside it).
func readyzIn(ns *testenv.Netns, addr string) bool {
	ok := false
	_ = ns.Do(func() error {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := conn.Write([]byte("GET /readyz HTTP/1.0\r\nHost: agent\r\n\r\n")); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			return err
		}
		resp.Body.Close()
		ok = resp.StatusCode == http.StatusOK
		return nil
	})
	return ok
}

// checkShippedProbes runs the shipped DaemonSet's probes as a kubelet runs
// exec probes: in the namespaces and root of the container whose process is
// pid.
func checkShippedProbes(t *testing.T, pid int) {
	t.Helper()
	c := agent(t, render(t))
	for name, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		args := append([]string{"--target", fmt.Sprint(pid), "--mount", "--net", "--root", "--wd", "--"}, p.Exec.Command...)
		if out, err := exec.Command("nsenter", args...).CombinedOutput(); err != nil {
			t.Errorf("the shipped %s probe %v in the image's container: %v\n%s", name, p.Exec.Command, err, out)
		}
	}
}

// queryIn asks server an A query for name from inside ns.
func queryIn(ns *testenv.Netns, name, server string) (*dns.Msg, error) {
	var r *dns.Msg
	err := ns.Do(func() error {
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(name), dns.TypeA)
		var err error
		r, _, err = (&dns.Client{Timeout: 2 * time.Second}).Exchange(m, server)
		return err
	})
	return r, err
}
