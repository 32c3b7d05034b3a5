//go:build !linux

package agent

import (
	"errors"
)

// errNotLinux: the agent's capture and its host setup are Linux's.
var errNotLinux = errors.New("meshdns-ebpf run needs Linux")

func effectiveCaps() (capSet, error) { return capSet{}, errNotLinux }
func mountBPFFS(string) error        { return errNotLinux }
