//go:build !linux

package main

import (
	"fmt"
	"os"
)

// The benchmark pins processes to CPUs, makes network namespaces and cgroups and
// loads eBPF programs: it runs on Linux only.
func main() {
	fmt.Fprintln(os.Stderr, "benchrun needs Linux (taskset, network namespaces, cgroups, eBPF)")
	os.Exit(1)
}
