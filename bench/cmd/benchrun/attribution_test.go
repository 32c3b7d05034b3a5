//go:build linux

package main

import "testing"

func TestPerfShares(t *testing.T) {
	rep := `# Total Lost Samples: 0
# Samples: 3K of event 'cpu-clock:pppH'
    88.77%     0.46%  [.] github.com/meshdns/meshdns-ebpf/internal/resolver.(*Server).readUDP
     7.74%     0.24%  [.] github.com/meshdns/meshdns-ebpf/internal/tap.stream
     2.27%     0.43%  [.] github.com/meshdns/meshdns-ebpf/internal/resolver.(*Server).observe
     0.35%     0.00%  [.] runtime.gcBgMarkWorker
     0.32%     0.00%  [.] runtime.gcBgMarkWorker.func2
     0.30%     0.05%  [.] github.com/prometheus/client_golang/prometheus.(*histogram).observe
     0.27%     0.27%  [.] github.com/meshdns/meshdns-ebpf/internal/redirect.(*Flows).Lookup
`
	got := perfShares(rep)
	want := map[string]float64{"samples": 3000, "stream": 0.0774, "observe": 0.0227, "gc": 0.0035, "lookup": 0.0027}
	for k, v := range want {
		if d := got[k] - v; d > 1e-9 || d < -1e-9 {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
	if len(got) != len(want) {
		t.Errorf("got %v, want %v", got, want)
	}
}
