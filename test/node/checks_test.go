package node

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/nodetest"
)

// checkInstall installs the agent with the commands of docs/kubernetes.md's
// Install section through the test overlay and measures the time to Ready.
func (e *env) checkInstall(t *testing.T) {
	ov := overlay(t, e.root, filepath.Join(e.dir, "overlay"), agentTag, e.n.UnifiedRoot)
	e.checkOverlayMinimal(t, ov)
	e.bpffsBefore = e.bpffs(t)
	start := time.Now()
	for _, args := range documented(t, e.root, "## Install", ov) {
		if slices.Contains(args, "rollout") {
			args = append(args, "--timeout=180s")
		}
		out, err := e.n.Kubectl(args...)
		if err != nil {
			t.Fatalf("kubectl %s: %v\n%s\n%s", strings.Join(args, " "), err, out, e.podsAndEvents(t))
		}
		t.Logf("kubectl %s (%v after apply):\n%s", strings.Join(args, " "), time.Since(start).Round(time.Millisecond), out)
		if slices.Contains(args, "rollout") {
			e.rep.add(t, "agent pod Ready %v after `kubectl apply -k` (shipped capabilities, mounts, probes, read-only root)",
				time.Since(start).Round(time.Millisecond))
		}
	}
	p := e.waitSettled(t, time.Minute)
	e.installed = true
	_, _, how := e.takeover(t, p.Metadata.Name)
	e.rep.add(t, "agent %s: %s", p.Metadata.Name, how)
}

// checkOverlayMinimal renders the shipped tree and the overlay as kubectl does and
// requires exactly two lines to differ: the container image and the cgroup
// volume's hostPath.
func (e *env) checkOverlayMinimal(t *testing.T, ov string) {
	t.Helper()
	base, err := e.n.Kubectl("kustomize", filepath.Join(e.root, "deploy", "kubernetes"))
	if err != nil {
		t.Fatal(err)
	}
	over, err := e.n.Kubectl("kustomize", ov)
	if err != nil {
		t.Fatal(err)
	}
	b, o := strings.Split(base, "\n"), strings.Split(over, "\n")
	if len(b) != len(o) {
		t.Fatalf("the overlay adds or removes lines (%d rendered, the shipped tree %d)", len(o), len(b))
	}
	var changed []string
	for i := range b {
		if b[i] != o[i] {
			changed = append(changed, strings.TrimSpace(b[i])+" -> "+strings.TrimSpace(o[i]))
		}
	}
	e.rep.add(t, "the test overlay changes %d fields of the shipped tree: %s", len(changed), strings.Join(changed, "; "))
	if len(changed) != 2 || !strings.HasPrefix(changed[0], "image:") || !strings.HasPrefix(changed[1], "path: /sys/fs/cgroup ->") {
		t.Fatalf("the overlay must change only the image and the cgroup hostPath, it changes: %v", changed)
	}
}

func (e *env) podsAndEvents(t *testing.T) string {
	pods, _ := e.n.Kubectl("get", "pods", "-A", "-o", "wide")
	events, _ := e.n.Kubectl("get", "events", "-n", agentNS)
	return pods + "\n" + events
}

// resolveCase is one lookup by one client pod.
type resolveCase struct {
	client, ns, pod string
	argv            []string
	name, want      string
}

// resolutionCases: every client resolves a ClusterIP Service, a headless
// Service, the ServiceEntry, a short name through its search path and an
// external name through the agent's upstream.
func (e *env) resolutionCases() []resolveCase {
	web, db := "web.team-a.svc.cluster.local", "db.team-b.svc.cluster.local"
	ext := "www." + externalZone
	var cs []resolveCase
	add := func(client, ns, pod string, argv []string, short string) {
		for _, q := range []struct{ name, want string }{
			{web, e.webIP}, {db, e.dbIP}, {serviceEntryHost, serviceEntryIP}, {short, e.webIP}, {ext, externalIP},
		} {
			cs = append(cs, resolveCase{client, ns, pod, argv, q.name, q.want})
		}
	}
	add("glibc getent", "team-a", "glibc", []string{"getent", "ahostsv4"}, "web")
	add("glibc dig", "team-a", "glibc", []string{"dig", "+short", "+search", "+time=2", "+tries=1"}, "web")
	add("musl", "team-a", "musl", []string{"muslresolve"}, "web")
	add("go", "team-b", "go", []string{"goresolve"}, "web.team-a")
	return cs
}

// checkResolution runs every case with kubectl exec in the client pods.
func (e *env) checkResolution(t *testing.T) {
	per := map[string][2]int{}
	for _, c := range e.resolutionCases() {
		args := append(append([]string{"exec", "-n", c.ns, c.pod, "--"}, c.argv...), c.name)
		out, err := e.n.Kubectl(args...)
		r := per[c.client]
		r[1]++
		if err == nil && hasField(out, c.want) {
			r[0]++
		} else {
			t.Errorf("%s (%s/%s) %s: want %s, got %v:\n%s", c.client, c.ns, c.pod, c.name, c.want, err, out)
		}
		per[c.client] = r
	}
	for _, client := range []string{"glibc getent", "glibc dig", "musl", "go"} {
		e.rep.add(t, "%s: %d of %d names resolved through the agent (ClusterIP, headless, ServiceEntry, short name, external)",
			client, per[client][0], per[client][1])
	}
}

func hasField(out, want string) bool {
	for _, f := range strings.Fields(out) {
		if f == want {
			return true
		}
	}
	return false
}

// checkCLI runs stats, status and table in the agent pod and scrapes /metrics
// at the node IP.
func (e *env) checkCLI(t *testing.T) {
	for _, cmd := range []string{"stats", "status", "table"} {
		out, err := e.n.Kubectl("exec", "-n", agentNS, "ds/meshdns-ebpf", "--", "meshdns-ebpf", cmd)
		if err != nil {
			t.Errorf("meshdns-ebpf %s: %v\n%s", cmd, err, out)
			continue
		}
		t.Logf("meshdns-ebpf %s:\n%s", cmd, out)
		switch cmd {
		case "stats":
			var named []string
			for _, p := range []string{"team-a/glibc", "team-a/musl", "team-b/go"} {
				if strings.Contains(out, "pod "+p) {
					named = append(named, p)
				}
			}
			if len(named) != 3 {
				t.Errorf("stats names the client pods %v, want all of team-a/glibc, team-a/musl, team-b/go", named)
			}
			e.rep.add(t, "`kubectl exec ... meshdns-ebpf stats` names the client pods %v", named)
		case "table":
			for _, name := range []string{"web.team-a.svc.cluster.local", serviceEntryHost} {
				if !strings.Contains(out, name) {
					t.Errorf("table lacks %s", name)
				}
			}
			e.rep.add(t, "`meshdns-ebpf status` and `table` ran in the agent pod (%d table lines)", strings.Count(out, "\n"))
		}
	}
	url := fmt.Sprintf("http://%s:9153/metrics", nodetest.NodeIP)
	body, err := e.n.HTTPGet(url)
	if err != nil || !strings.Contains(body, "meshdns_") {
		t.Errorf("GET %s: %v (%d bytes, meshdns_ metrics: %v)", url, err, len(body), strings.Contains(body, "meshdns_"))
	} else {
		e.rep.add(t, "GET %s: %d meshdns_ sample lines", url, countPrefix(body, "meshdns_"))
	}
	// The node IP is reachable from every pod: the debug endpoints (the name
	// table, the node's pods) must not be served there.
	var served []string
	for _, path := range []string{"/debug/table", "/debug/pods", "/debug/sources", "/debug/ndsz"} {
		if _, err := e.n.HTTPGet(fmt.Sprintf("http://%s:9153%s", nodetest.NodeIP, path)); err == nil {
			served = append(served, path)
		}
	}
	e.rep.add(t, "debug endpoints served at the node IP: %s", orNothing(served))
	if len(served) > 0 {
		t.Errorf("the node-IP listener serves %v to every pod", served)
	}
}

func countPrefix(body, prefix string) int {
	n := 0
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}
