package kubetest

import "syscall"

// dieWithParent: the kernel kills a control-plane process when the test binary
// that started it dies (TestChildrenDieWithTestBinary).
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}

// intoCgroup starts the child in the cgroup2 directory open as fd.
func intoCgroup(a *syscall.SysProcAttr, fd int) { a.UseCgroupFD, a.CgroupFD = true, fd }
