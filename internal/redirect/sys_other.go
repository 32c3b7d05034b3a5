//go:build !linux

package redirect

import "errors"

// errNotLinux: cgroup sock_addr programs and bpffs are Linux's.
var errNotLinux = errors.New("the eBPF datapath needs Linux")

// Values of Linux's ABI that only programs loaded on Linux use (the loads fail
// here first).
const (
	solSocket         = 1
	soMark            = 36
	bpfNoPrealloc     = 1
	bpfQueryEffective = 1
)

// OnBPFFS fails: bpffs is Linux's.
func OnBPFFS(string) (int64, bool, error) { return 0, false, errNotLinux }

// ownNetnsCookie fails: network namespace cookies are Linux's.
func ownNetnsCookie() (uint64, error) { return 0, errNotLinux }
