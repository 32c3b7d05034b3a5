//go:build benchpprof

package main

// A build for the benchmark only (`go build -tags benchpprof`, bench/run.sh
// budgets with BENCH_PPROF=1): net/http/pprof on the loopback address in
// $MESHDNS_BENCH_PPROF, so the harness can take the agent's heap profile at a
// phase's end. Release builds do not have it.

import (
	"log/slog"
	"net"
	"net/http"
	_ "net/http/pprof" // registers /debug/pprof/ on http.DefaultServeMux
	"net/netip"
	"os"
)

func init() {
	addr := os.Getenv("MESHDNS_BENCH_PPROF")
	if addr == "" {
		return
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().IsLoopback() {
		slog.Error("MESHDNS_BENCH_PPROF: want a loopback host:port", "addr", addr)
		return
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		slog.Error("bench pprof listener", "addr", addr, "err", err)
		return
	}
	go func() { _ = http.Serve(ln, nil) }()
}
