//go:build !linux

package kubetest

import "syscall"

// dieWithParent: only Linux kills children with their parent (Pdeathsig);
// elsewhere a test that dies leaves its control plane running.
func dieWithParent() *syscall.SysProcAttr { return &syscall.SysProcAttr{} }

// intoCgroup: cgroups are Linux only.
func intoCgroup(*syscall.SysProcAttr, int) {}
