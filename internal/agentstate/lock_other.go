//go:build !linux

package agentstate

import (
	"errors"
	"os"
)

// errNotLinux: the state lock is an open file description lock, Linux's.
var errNotLinux = errors.New("the agent's state lock needs Linux")

func setLock(*os.File) error          { return errNotLinux }
func lockHeld(*os.File) (bool, error) { return false, errNotLinux }
