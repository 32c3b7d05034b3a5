package kube

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The mesh run: N Istio ServiceEntries in the local cluster
// (one in five without addresses, so the agent allocates its VIP) plus N
// Services split over the local and a remote cluster (a second API server
// on the same etcd, read through --remote-kubeconfigs). It measures the
// agent's time to ready and memory after sync, then update -> answer
// latency for ServiceEntry address changes and the remote cluster's
// headless endpoint changes, both at churnRate/s at once.

type meshResult struct {
	entries, services, vips int
	ready                   time.Duration
	rssSynced, hwmSynced    uint64
	rssChurn, hwmChurn      uint64
	se, remote              updates
	churn                   time.Duration
}

type updates struct {
	lat           []time.Duration
	total, missed int
}

func seHost(i int) string { return fmt.Sprintf("se-%d.ext%d.example.", i, i%namespaces) }
func seVIP(i int) bool    { return i%5 == 4 }
func seIP(i, gen int) string {
	return fmt.Sprintf("198.%d.%d.%d", 18+gen%2, i>>8&0xff, i&0xff)
}

func runMesh(t *testing.T, s settings) meshResult {
	n := s.mesh
	args := []string{"--service-cluster-ip-range=10.96.0.0/12", "--max-requests-inflight=2000", "--max-mutating-requests-inflight=1000"}
	local := kubetest.Start(t, kubetest.Options{Users: []string{"bench"}, APIServerArgs: args})
	east := kubetest.Start(t, kubetest.Options{Users: []string{"bench"}, ShareEtcd: local, APIServerArgs: args})
	local.InstallServiceEntryCRD(t)
	kubeconfig := benchUser(t, local)
	dir := t.TempDir()
	remotes := filepath.Join(dir, "remote")
	if err := os.Mkdir(remotes, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(remotes, "east"), readFileT(t, benchUser(t, east)), 0o600); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	populateRange(t, local, 0, n/2)
	eastHeadless := populateRange(t, east, n/2, n)
	populateEntries(t, local, n)
	t.Logf("mesh: %d ServiceEntries and %d+%d Services in two clusters created in %v", n, n/2, n-n/2, time.Since(start).Round(time.Second))

	r := meshResult{entries: n, services: n}
	for i := range n {
		if seVIP(i) {
			r.vips++
		}
	}
	up := testenv.StartFakeDNS(t, nil, "127.0.0.1:0", nil)
	port := testenv.FreePort(t)
	began := time.Now()
	cmd := startServer(t, s, "meshdns", dir, kubeconfig, port, up.Addr, "--remote-kubeconfigs", remotes)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	// Ready: the last ServiceEntry with an address, the last VIP one, the
	// last local and the last remote ClusterIP Service all answer.
	lastAddr, lastVIP := n-1, n-1
	for seVIP(lastAddr) {
		lastAddr--
	}
	for !seVIP(lastVIP) {
		lastVIP--
	}
	lastLocal, lastRemote := n/2-1, n-1
	for isHeadless(lastLocal) {
		lastLocal--
	}
	for isHeadless(lastRemote) {
		lastRemote--
	}
	wantLocal, wantRemote := clusterIP(t, local, lastLocal), clusterIP(t, east, lastRemote)
	if !testenv.WaitFor(readyTimeout(2*n), func() bool {
		return ask(addr, seHost(lastAddr)) == seIP(lastAddr, 0) && strings.HasPrefix(ask(addr, seHost(lastVIP)), "240.240.") &&
			ask(addr, name(lastLocal)) == wantLocal && ask(addr, name(lastRemote)) == wantRemote
	}) {
		t.Fatalf("mesh: meshdns never answered everything: %s=%q %s=%q %s=%q %s=%q", seHost(lastAddr), ask(addr, seHost(lastAddr)),
			seHost(lastVIP), ask(addr, seHost(lastVIP)), name(lastLocal), ask(addr, name(lastLocal)), name(lastRemote), ask(addr, name(lastRemote)))
	}
	r.ready = time.Since(began)
	time.Sleep(3 * time.Second) // let the initial sync's garbage be collected (as the single-cluster run)
	if m, err := procstat.Memory(cmd.Process.Pid); err == nil {
		r.rssSynced, r.hwmSynced = m.RSS, m.HWM
	}

	ctx, cancel := context.WithCancel(context.Background())
	remoteLat, remoteMissed, remoteTotal := churn(ctx, t, east, addr, eastHeadless)
	var withAddr []int
	for i := range n {
		if !seVIP(i) {
			withAddr = append(withAddr, i)
		}
	}
	seLat, seMissed, seTotal := entryChurn(ctx, t, local, addr, withAddr)
	var peak procstat.Mem
	sampler := make(chan struct{})
	go func() {
		defer close(sampler)
		for ctx.Err() == nil {
			if m, err := procstat.Memory(cmd.Process.Pid); err == nil {
				peak.RSS, peak.HWM = max(peak.RSS, m.RSS), max(peak.HWM, m.HWM)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}()
	time.Sleep(2*time.Second + s.duration) // the churn's length
	cancel()
	<-sampler
	r.churn = 2*time.Second + s.duration
	r.rssChurn, r.hwmChurn = peak.RSS, peak.HWM
	r.se = updates{lat: seLat(), total: int(seTotal.Load()), missed: int(seMissed.Load())}
	r.remote = updates{lat: remoteLat(), total: int(remoteTotal.Load()), missed: int(remoteMissed.Load())}
	stop(cmd)
	t.Logf("mesh: ready %v, RSS %d MB (VmHWM %d MB), churn RSS %d MB VmHWM %d MB; ServiceEntry update->answer %s; remote headless update->answer %s",
		r.ready.Round(time.Millisecond), r.rssSynced>>20, r.hwmSynced>>20, r.rssChurn>>20, r.hwmChurn>>20, r.se, r.remote)
	return r
}

func (u updates) String() string {
	if len(u.lat) == 0 {
		return fmt.Sprintf("none (%d updates, %d missed)", u.total, u.missed)
	}
	return fmt.Sprintf("p50 %v p99 %v max %v (%d updates, %d not seen in 5 s)", pct(u.lat, 0.5), pct(u.lat, 0.99), pct(u.lat, 1), u.total, u.missed)
}

func readFileT(t *testing.T, p string) []byte {
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func entry(i, gen int) *unstructured.Unstructured {
	spec := map[string]any{"hosts": []any{strings.TrimSuffix(seHost(i), ".")}, "resolution": "DNS",
		"ports": []any{map[string]any{"number": int64(443), "name": "https", "protocol": "TLS"}}}
	if !seVIP(i) {
		spec["resolution"] = "NONE"
		spec["addresses"] = []any{seIP(i, gen)}
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": kubetest.ServiceEntryGVR.GroupVersion().String(), "kind": "ServiceEntry",
		"metadata": map[string]any{"name": fmt.Sprintf("se-%d", i), "namespace": fmt.Sprintf("bench-%d", i%namespaces)},
		"spec":     spec,
	}}
}

// populateEntries creates n ServiceEntries in the bench namespaces.
func populateEntries(t *testing.T, cp *kubetest.ControlPlane, n int) {
	rc := cp.RESTConfig(t, kubetest.Admin)
	rc.QPS, rc.Burst = 5000, 5000
	rc.Timeout = time.Minute
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	err = createAll(0, n, func(i int) error {
		e := entry(i, 0)
		return retryCreate("ServiceEntry "+e.GetNamespace()+"/"+e.GetName(), func(ctx context.Context) error {
			_, err := dc.Resource(kubetest.ServiceEntryGVR).Namespace(e.GetNamespace()).Create(ctx, e, metav1.CreateOptions{})
			return err
		})
	})
	if err != nil {
		t.Fatalf("populate ServiceEntries: %v", err)
	}
}

// entryChurn changes the address of ServiceEntries at churnRate per second
// until ctx ends (churnLoop).
func entryChurn(ctx context.Context, t *testing.T, cp *kubetest.ControlPlane, addr string, idx []int) (lat func() []time.Duration, missed, total *atomic.Int64) {
	dc := cp.DynamicClient()
	return churnLoop(ctx, addr, idx, func(octx context.Context, i, gen int) (string, string, bool) {
		res := dc.Resource(kubetest.ServiceEntryGVR).Namespace(fmt.Sprintf("bench-%d", i%namespaces))
		cur, err := res.Get(octx, fmt.Sprintf("se-%d", i), metav1.GetOptions{})
		if err != nil {
			return "", "", false
		}
		// The other of the entry's two addresses, so every update changes
		// the answer.
		ip := seIP(i, gen)
		if old, _, _ := unstructured.NestedStringSlice(cur.Object, "spec", "addresses"); len(old) > 0 && old[0] == ip {
			ip = seIP(i, gen+1)
		}
		if err := unstructured.SetNestedSlice(cur.Object, []any{ip}, "spec", "addresses"); err != nil {
			return "", "", false
		}
		if _, err := res.Update(octx, cur, metav1.UpdateOptions{}); err != nil {
			return "", "", false
		}
		return seHost(i), ip, true
	})
}

// renderMesh prints the mesh run beside the single-cluster meshdns rows.
func renderMesh(m meshResult, rs []result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n## Mesh: ServiceEntries and two clusters\n\n")
	fmt.Fprintf(&b, "meshdns with `--kubeconfig` (local cluster, Istio's ServiceEntry CRD installed) and `--remote-kubeconfigs` (a second kube-apiserver on the same etcd). "+
		"%d ServiceEntries in the local cluster (one in five without addresses: %d VIPs allocated by the agent), %d Services split over the two clusters (one in %d headless, one ready endpoint each). "+
		"Updates: ServiceEntry `spec.addresses` changes and the remote cluster's headless EndpointSlice changes, %d/s each at once for %v; update -> answer timed from the API write's return (polled every 1 ms). "+
		"The single-cluster rows are the table above's meshdns rows (Services only).\n\n",
		m.entries, m.vips, m.services, headlessEach, churnRate, m.churn)
	fmt.Fprintf(&b, "| setup | objects | time to ready | RSS after sync | RSS / VmHWM during updates | update -> answer p50 / p99 / max | updates (missed) |\n")
	fmt.Fprintf(&b, "|---|---:|---:|---:|---|---|---:|\n")
	for _, r := range rs {
		if r.server == "meshdns" {
			fmt.Fprintf(&b, "| single cluster | %d Services | %v | %d MB | %d / %d MB | %v / %v / %v | %d (%d) |\n",
				r.scale, r.ready.Round(time.Millisecond), r.rssSynced>>20, r.rssChurn>>20, r.hwmChurn>>20, r.updP50, r.updP99, r.updMax, r.updates, r.updMissed)
		}
	}
	row := func(what string, u updates) {
		var p50, p99, mx time.Duration
		if len(u.lat) > 0 {
			p50, p99, mx = pct(u.lat, 0.5), pct(u.lat, 0.99), pct(u.lat, 1)
		}
		fmt.Fprintf(&b, "| mesh, %s | %d ServiceEntries + %d Services | %v | %d MB | %d / %d MB | %v / %v / %v | %d (%d) |\n",
			what, m.entries, m.services, m.ready.Round(time.Millisecond), m.rssSynced>>20, m.rssChurn>>20, m.hwmChurn>>20, p50, p99, mx, u.total, u.missed)
	}
	row("ServiceEntry address updates", m.se)
	row("remote headless updates", m.remote)
	return b.String()
}
