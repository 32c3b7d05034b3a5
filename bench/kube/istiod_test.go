package kube

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/bench/internal/procstat"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The istiod run: N Services on one API server with a real
// istiod (pilot-discovery, internal/kubetest) on it. The agent runs once
// with the Kubernetes source (--kubeconfig) and once with the NDS source
// alone (--istiod, plaintext, one view), each measured for time to ready,
// memory after sync and during updates, and update -> answer latency of
// headless EndpointSlice changes, made one at a time (each waits for its
// answer): istiod debounces pushes (100 ms of quiet, at most 10 s), so a
// steady 50/s stream would measure its debounce limit, not the source.

type istiodResult struct {
	source              string
	services            int
	ready               time.Duration
	rssSynced, hwm      uint64
	rssUpd, hwmUpd      uint64
	upd                 updates
	istiodRSS, istiodHW uint64
}

const istiodUpdates = 100

func runIstiod(t *testing.T, s settings) []istiodResult {
	n := s.istiod
	cp := kubetest.Start(t, kubetest.Options{Users: []string{"bench"},
		APIServerArgs: []string{"--service-cluster-ip-range=10.96.0.0/12", "--max-requests-inflight=2000", "--max-mutating-requests-inflight=1000"}})
	kubeconfig := benchUser(t, cp)
	start := time.Now()
	headless := populate(t, cp, n)
	t.Logf("istiod: %d Services and EndpointSlices created in %v", n, time.Since(start).Round(time.Second))
	is := cp.StartIstiod(t, kubetest.IstiodOptions{})
	lastIdx := n - 1
	for isHeadless(lastIdx) {
		lastIdx--
	}
	want := clusterIP(t, cp, lastIdx)
	up := testenv.StartFakeDNS(t, nil, "127.0.0.1:0", nil)
	dir := t.TempDir()
	var out []istiodResult
	for _, src := range []string{"kubernetes", "istiod"} {
		r := istiodResult{source: src, services: n}
		port := testenv.FreePort(t)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		srv := "meshdns"
		var extra []string
		if src == "istiod" {
			srv = "meshdns-istiod"
			extra = []string{"--istiod", is.GRPCAddr, "--namespace", "bench-0", "--istiod-view", "agent"}
		}
		began := time.Now()
		cmd := startServer(t, s, srv, dir, kubeconfig, port, up.Addr, extra...)
		if !testenv.WaitFor(readyTimeout(n)+2*time.Minute, func() bool { return ask(addr, name(lastIdx)) == want }) {
			t.Fatalf("istiod run, %s source: never answered %s with %s (got %q)", src, name(lastIdx), want, ask(addr, name(lastIdx)))
		}
		r.ready = time.Since(began)
		time.Sleep(3 * time.Second) // let the initial sync's garbage be collected (as the other runs)
		if m, err := procstat.Memory(cmd.Process.Pid); err == nil {
			r.rssSynced, r.hwm = m.RSS, m.HWM
		}
		if m, err := procstat.Memory(is.PID()); err == nil {
			r.istiodRSS, r.istiodHW = m.RSS, m.HWM
		}
		r.upd, r.rssUpd, r.hwmUpd = sequentialUpdates(t, cp, addr, headless, cmd.Process.Pid, src)
		stop(cmd)
		t.Logf("istiod run, %s source: ready %v, RSS %d MB, during updates %d MB (VmHWM %d MB); update -> answer %s; istiod RSS %d MB",
			src, r.ready.Round(time.Millisecond), r.rssSynced>>20, r.rssUpd>>20, r.hwmUpd>>20, r.upd, r.istiodRSS>>20)
		out = append(out, r)
	}
	return out
}

// sequentialUpdates changes a headless Service's endpoint istiodUpdates
// times, one after the other, each timed from the API write's return
// until the agent answers the new address (polled every 1 ms, at most
// 15 s: missed). It also samples the agent's peak memory meanwhile.
func sequentialUpdates(t *testing.T, cp *kubetest.ControlPlane, addr string, headless []int, pid int, src string) (u updates, rss, hwm uint64) {
	cs := cp.AdminClient()
	for k := range istiodUpdates {
		i := headless[(k*7919)%len(headless)]
		ns, svc := fmt.Sprintf("bench-%d", i%namespaces), fmt.Sprintf("svc-%d", i)
		gen := k + 1
		if src == "istiod" {
			gen += istiodUpdates // addresses the first run has not used
		}
		ip := endpointIP(i, gen)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cur, err := cs.DiscoveryV1().EndpointSlices(ns).Get(ctx, svc, metav1.GetOptions{})
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		es := slice(ns, svc, ip)
		es.ResourceVersion = cur.ResourceVersion
		_, err = cs.DiscoveryV1().EndpointSlices(ns).Update(ctx, es, metav1.UpdateOptions{})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		written := time.Now()
		u.total++
		for {
			if ask(addr, name(i)) == ip {
				u.lat = append(u.lat, time.Since(written))
				break
			}
			if time.Since(written) > 15*time.Second {
				u.missed++
				break
			}
			time.Sleep(time.Millisecond)
		}
		if m, err := procstat.Memory(pid); err == nil {
			rss, hwm = max(rss, m.RSS), max(hwm, m.HWM)
		}
	}
	return u, rss, hwm
}

// renderIstiod prints the istiod run.
func renderIstiod(rs []istiodResult, s settings) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n## NDS source (istiod) beside the Kubernetes source\n\n")
	if len(rs) == 0 {
		return b.String()
	}
	fmt.Fprintf(&b, "One kube-apiserver %s with %d Services (as above: one EndpointSlice of one ready endpoint each, one in %d headless) and a real istiod (pilot-discovery from istio.io/istio %s) on it. "+
		"meshdns `run --mode off` once with `--kubeconfig` (the Kubernetes source), once with `--istiod` alone (plaintext xDS, `--istiod-view agent`: one view). "+
		"Updates: %d headless EndpointSlice changes one after the other (the next is written once the previous one is answered), each timed from the API write's return to the first answer with the new address (polled every 1 ms); "+
		"through istiod that includes its push debounce (PILOT_DEBOUNCE_AFTER, 100 ms by default).\n\n",
		kubetest.KubeVersion, rs[0].services, headlessEach, kubetest.IstioVersion, istiodUpdates)
	fmt.Fprintf(&b, "| source | time to ready | RSS after sync | RSS / VmHWM during updates | update -> answer p50 / p99 / max | updates (missed) | istiod RSS |\n")
	fmt.Fprintf(&b, "|---|---:|---:|---|---|---:|---:|\n")
	for _, r := range rs {
		var p50, p99, mx time.Duration
		if len(r.upd.lat) > 0 {
			p50, p99, mx = pct(r.upd.lat, 0.5), pct(r.upd.lat, 0.99), pct(r.upd.lat, 1)
		}
		fmt.Fprintf(&b, "| %s | %v | %d MB | %d / %d MB | %v / %v / %v | %d (%d) | %d MB |\n",
			r.source, r.ready.Round(time.Millisecond), r.rssSynced>>20, r.rssUpd>>20, r.hwmUpd>>20, p50, p99, mx, r.upd.total, r.upd.missed, r.istiodRSS>>20)
	}
	return b.String()
}
