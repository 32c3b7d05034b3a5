package kubetest

import "syscall"

// dieWithParent: the kernel kills a control-plane process when the test binary
// that started it dies (TestChildrenDieWithTestBinary).
func dieWithParent() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
