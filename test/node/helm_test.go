package node

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// helmSection is the heading of docs/kubernetes.md whose three sh blocks the Helm
// checks run: install, upgrade, uninstall.
const helmSection = "### Helm"

// helmBin is helm as scripts/build-tools.sh builds it (.cache/tools-bin, or
// $MESHDNS_TOOLS_BIN); without it the Helm checks skip (fail under CI=true).
func helmBin(t *testing.T, root string) string {
	t.Helper()
	dir := os.Getenv("MESHDNS_TOOLS_BIN")
	if dir == "" {
		dir = filepath.Join(root, ".cache", "tools-bin")
	}
	p := filepath.Join(dir, "helm")
	if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
		testenv.Skip(t, "helm is not built in %s: run `make tools-bin` (scripts/build-tools.sh), or set MESHDNS_TOOLS_BIN", dir)
	}
	return p
}

// documentedBlock returns the command lines (argv, program first) of the nth
// (from 0) sh block under heading in docs/kubernetes.md, up to the next heading.
func documentedBlock(t *testing.T, root, heading string, nth int) [][]string {
	t.Helper()
	f, err := os.Open(filepath.Join(root, "docs", "kubernetes.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cmds [][]string
	inSection, inBlock, block := false, false, -1
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case l == heading:
			inSection = true
		case inSection && !inBlock && strings.HasPrefix(l, "#"):
			inSection = false
		case inSection && !inBlock && l == "```sh":
			inBlock, block = true, block+1
		case inBlock && l == "```":
			inBlock = false
			if block == nth {
				return cmds
			}
		case inBlock && block == nth && strings.TrimSpace(l) != "" && !strings.HasPrefix(l, "#"):
			cmds = append(cmds, strings.Fields(l))
		}
	}
	t.Fatalf("docs/kubernetes.md: no sh block %d under %q", nth, heading)
	return nil
}

// runDocumented runs the commands of the nth sh block of the Helm section on the
// node: kubectl with the admin kubeconfig, helm with the same and the chart of
// this checkout. The example image becomes the node's imported one (tag), and the
// install gets cgroupPath = the node's pod cgroup root (as the kubectl path's
// overlay does): nothing else differs from what the docs say.
func (e *env) runDocumented(t *testing.T, nth int, tag string) {
	t.Helper()
	helm := helmBin(t, e.root)
	kubeconfig := e.n.CP.Kubeconfig(t, kubetest.Admin)
	repl := strings.NewReplacer(
		"image.repository=registry.example.com/team/meshdns-ebpf", "image.repository="+agentRepo,
		"image.tag=TAG", "image.tag="+tag, "image.tag=NEWTAG", "image.tag="+tag,
		"--timeout=30m", "--timeout=180s")
	for _, argv := range documentedBlock(t, e.root, helmSection, nth) {
		for i := range argv {
			argv[i] = repl.Replace(argv[i])
			if argv[i] == "charts/meshdns-ebpf" {
				argv[i] = filepath.Join(e.root, "charts", "meshdns-ebpf")
			}
		}
		start := time.Now()
		var out string
		var err error
		switch argv[0] {
		case "kubectl":
			out, err = e.n.Kubectl(argv[1:]...)
		case "helm":
			args := append([]string{"--kubeconfig", kubeconfig}, argv[1:]...)
			if argv[1] == "install" {
				args = append(args, "--set", "cgroupPath="+e.n.UnifiedRoot)
			}
			out, err = e.n.Run(helm, args...)
		default:
			t.Fatalf("docs/kubernetes.md %s: %q is neither kubectl nor helm", helmSection, strings.Join(argv, " "))
		}
		if err != nil {
			t.Fatalf("%s: %v\n%s\n%s", strings.Join(argv, " "), err, out, e.podsAndEvents(t))
		}
		t.Logf("%s (%v):\n%s", strings.Join(argv, " "), time.Since(start).Round(time.Millisecond), out)
	}
}

// checkHelmInstall installs the chart with the Helm section's first block, after the
// kubectl path's uninstall: the same agent, the same node.
func (e *env) checkHelmInstall(t *testing.T) {
	helmBin(t, e.root)
	if left := e.leftovers(t); len(left) > 0 {
		t.Fatalf("the node is not clean before the Helm install: %s", strings.Join(left, "; "))
	}
	start := time.Now()
	e.runDocumented(t, 0, agentTag)
	p := e.waitSettled(t, time.Minute)
	e.tag, e.helmInstalled = agentTag, true
	_, _, how := e.takeover(t, p.Metadata.Name)
	e.rep.add(t, "`helm install` (docs' commands): agent pod %s Ready %v after the first command; %s",
		p.Metadata.Name, time.Since(start).Round(time.Millisecond), how)
	e.checkResolution(t)
}

// checkHelmUninstall runs the Helm section's third block and checks the node as
// the kubectl path's uninstall does.
func (e *env) checkHelmUninstall(t *testing.T) {
	start := time.Now()
	e.runDocumented(t, 2, e.tag)
	e.checkUninstalled(t, "`helm uninstall` and the namespace's deletion", start)
	e.helmInstalled = false
}
