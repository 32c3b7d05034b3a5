package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"maps"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
)

// Helpers of the mesh tests: ServiceEntries, remote clusters, the CLI.

// createSE creates a ServiceEntry ns/name with spec and returns it as
// stored (creation timestamp, UID).
func createSE(t *testing.T, c *cluster, ns, name string, spec map[string]any) *unstructured.Unstructured {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": kubetest.ServiceEntryGVR.GroupVersion().String(),
		"kind":       "ServiceEntry",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       spec,
	}}
	out, err := c.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace(ns).Create(ctx, u, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create ServiceEntry %s/%s: %v", ns, name, err)
	}
	return out
}

// setSEStatusAddresses writes status.addresses as Istio's allocator does:
// pairs of host and address.
func setSEStatusAddresses(t *testing.T, c *cluster, ns, name string, pairs ...[2]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res := c.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace(ns)
	u, err := res.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var addrs []any
	for _, p := range pairs {
		addrs = append(addrs, map[string]any{"host": p[0], "value": p[1]})
	}
	if err := unstructured.SetNestedSlice(u.Object, addrs, "status", "addresses"); err != nil {
		t.Fatal(err)
	}
	if _, err := res.UpdateStatus(ctx, u, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("write status.addresses of %s/%s: %v", ns, name, err)
	}
}

func deleteSE(t *testing.T, c *cluster, ns, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

func strs(v ...string) []any {
	out := make([]any, len(v))
	for i, s := range v {
		out[i] = s
	}
	return out
}

// vipHome is the documented home slot of a host's VIP
// (docs/name-table.md): FNV-1a of the lower-case FQDN, mod 65534, plus 1.
func vipHome(fqdn string) int {
	h := fnv.New64a()
	_, _ = h.Write([]byte(fqdn))
	return int(h.Sum64()%65534) + 1
}

// vipOf is the VIP pair of slot s: 240.240.<s/256>.<s%256> and
// 2001:2::f0f0:<s>.
func vipOf(s int) (string, string) {
	v6 := netip.AddrFrom16([16]byte{0x20, 0x01, 0, 0x02, 12: 0xf0, 13: 0xf0, 14: byte(s >> 8), 15: byte(s)})
	return fmt.Sprintf("240.240.%d.%d", s>>8, s&0xff), v6.String()
}

// slotOf is the slot of a VIP 240.240.x.y, or -1.
func slotOf(v4 string) int {
	a, err := netip.ParseAddr(v4)
	if err != nil || !netip.MustParsePrefix("240.240.0.0/16").Contains(a) {
		return -1
	}
	b := a.As4()
	return int(b[2])<<8 | int(b[3])
}

// remoteRole is what a remote cluster's source reads: Services and
// EndpointSlices (no Pods: its clients are not on this node).
var remoteRole = []rbacv1.PolicyRule{
	{APIGroups: []string{""}, Resources: []string{"services"}, Verbs: []string{"get", "list", "watch"}},
	{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"get", "list", "watch"}},
}

// startRemote runs a second cluster on the local one's etcd (its own
// prefix: isolated) with the controller-manager, and an agent identity
// bound to remoteRole. Its kubeconfig is what a remote secret holds.
func startRemote(t *testing.T, local *cluster) *cluster {
	t.Helper()
	cp := kubetest.Start(t, kubetest.Options{ControllerManager: true, Users: []string{agentUser}, ShareEtcd: local.ControlPlane})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "meshdns-test-remote"}, Rules: remoteRole}
	if _, err := cp.AdminClient().RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cp.BindClusterRole(t, role.Name, agentUser)
	return &cluster{ControlPlane: cp, kubeconfig: cp.Kubeconfig(t, agentUser)}
}

// cli runs the meshdns-ebpf CLI and returns its stdout.
func cli(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command(agenttest.Agent(t), args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("meshdns-ebpf %s: %v\n%s%s", strings.Join(args, " "), err, out.String(), errb.String())
	}
	return out.String()
}

// cliJSON runs the CLI with -o json and decodes its output into v.
func cliJSON(t *testing.T, v any, args ...string) {
	t.Helper()
	out := cli(t, append(args, "-o", "json")...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("meshdns-ebpf %s -o json: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// sourceStatus is what `status -o json` says of one name source.
type sourceStatus struct {
	Name         string    `json:"name"`
	Synced       bool      `json:"synced"`
	Objects      int       `json:"objects"`
	LastUpdate   time.Time `json:"lastUpdate"`
	LastError    string    `json:"lastError"`
	FailingSince time.Time `json:"failingSince"`
}

func (a *agent) sources(t *testing.T) map[string]sourceStatus {
	t.Helper()
	var st struct {
		Ready   string         `json:"ready"`
		Sources []sourceStatus `json:"sources"`
	}
	cliJSON(t, &st, "status", "--admin", a.admin, "--state-dir", t.TempDir(), "--bpffs", t.TempDir())
	out := map[string]sourceStatus{}
	for _, s := range st.Sources {
		out[s.Name] = s
	}
	return out
}

// secretDir is a directory laid out as kubelet mounts a Secret: each key a
// symlink into ..data, which points at a timestamped directory and is
// swapped atomically (rename) on every update.
type secretDir struct {
	t   *testing.T
	dir string
	gen int
}

func newSecretDir(t *testing.T) *secretDir {
	return &secretDir{t: t, dir: t.TempDir()}
}

// write replaces the directory's content with files, as kubelet's atomic
// writer does.
func (s *secretDir) write(files map[string][]byte) {
	t := s.t
	t.Helper()
	s.gen++
	ts := fmt.Sprintf("..2025_01_01_00_00_%02d.%d", s.gen%60, s.gen)
	if err := os.Mkdir(filepath.Join(s.dir, ts), 0o755); err != nil {
		t.Fatal(err)
	}
	for k, v := range files {
		if err := os.WriteFile(filepath.Join(s.dir, ts, k), v, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	old, _ := os.Readlink(filepath.Join(s.dir, "..data"))
	if err := os.Symlink(ts, filepath.Join(s.dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(s.dir, "..data_tmp"), filepath.Join(s.dir, "..data")); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(s.dir)
	for _, e := range ents {
		if n := e.Name(); !strings.HasPrefix(n, ".") {
			if _, keep := files[n]; !keep {
				_ = os.Remove(filepath.Join(s.dir, n))
			}
		}
	}
	for k := range files {
		if _, err := os.Lstat(filepath.Join(s.dir, k)); err != nil {
			if err := os.Symlink(filepath.Join("..data", k), filepath.Join(s.dir, k)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if old != "" {
		_ = os.RemoveAll(filepath.Join(s.dir, old))
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// query is a name and the answer it must keep getting.
type query struct{ name, want string }

// queryWhile asks each query every 5 ms (one goroutine each) until the
// returned function is called; that returns how many were sent, how many
// failed, and each distinct failure ("name -> answer", sorted).
func (a *agent) queryWhile(qs ...query) func() (sent, failed int64, failures []string) {
	var sentN, failedN atomic.Int64
	var mu sync.Mutex
	failed := map[string]bool{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, q := range qs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(5 * time.Millisecond) // the queries' pace
			defer tick.Stop()
			for {
				select {
				case <-stop:
					return
				case <-tick.C:
				}
				sentN.Add(1)
				resp, err := a.query("", q.name, dns.TypeA)
				if err != nil || answer(resp) != q.want {
					failedN.Add(1)
					got := fmt.Sprint(err)
					if resp != nil {
						got = answer(resp)
					}
					mu.Lock()
					failed[q.name+" -> "+got] = true
					mu.Unlock()
				}
			}
		}()
	}
	return func() (int64, int64, []string) {
		close(stop)
		wg.Wait()
		return sentN.Load(), failedN.Load(), slices.Sorted(maps.Keys(failed))
	}
}
