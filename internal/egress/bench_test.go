package egress

import (
	"context"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// BenchmarkConnect is the CPU a client spends per connect (a connected UDP
// socket: socket, connect, close; no TIME_WAIT to run out of ports) in a
// cgroup under the datapath, measured by the client itself (getrusage
// around its loop): "off" with no egress policy (the programs test one flag),
// "unselected" with egress on but the cgroup no workload (the ancestor walk
// finds none), "granted" in a selected cgroup (enforce) connecting to a
// granted address. The cpu-ns/connect metric is what to compare.
func BenchmarkConnect(b *testing.B) {
	for _, mode := range []string{"off", "unselected", "granted"} {
		b.Run(mode, func(b *testing.B) {
			e := newEnv(b, envOpts{})
			cg := e.cg.Child(b, "client")
			if mode != "off" {
				if err := e.eg.Enable(true); err != nil {
					b.Fatal(err)
				}
			}
			if mode == "granted" {
				if err := e.eg.SetWorkload(cg.ID(b), 1, enforce); err != nil {
					b.Fatal(err)
				}
				if err := e.eg.Grants().Grant(1, "bench.test", []netip.Addr{inet1}, nil, time.Hour); err != nil {
					b.Fatal(err)
				}
			}
			target := dst("udpc", inet1, port)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			b.ResetTimer()
			cmd := testenv.Command(ctx, testenv.Proc{Netns: e.net, Cgroup: cg, UID: userUID, GID: userUID},
				clientBin, "loop", strconv.Itoa(b.N), target)
			cmd.Env = append(os.Environ(), clientEnv+"=1")
			out, err := cmd.CombinedOutput()
			b.StopTimer()
			if err != nil {
				b.Fatalf("client: %v: %s", err, out)
			}
			ns, ok := strings.CutPrefix(strings.TrimSpace(string(out)), "cpu_ns ")
			cpu, perr := strconv.ParseInt(ns, 10, 64)
			if !ok || perr != nil {
				b.Fatalf("client output %q", out)
			}
			b.ReportMetric(float64(cpu)/float64(b.N), "cpu-ns/connect")
			if mode == "granted" {
				if c := e.counts(b, 1); c.AllowedGrant < uint64(b.N) || c.Denied != 0 {
					b.Fatalf("counts %+v after %d connects", c, b.N)
				}
			}
		})
	}
}
