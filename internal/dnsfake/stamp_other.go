//go:build !linux

package dnsfake

import (
	"net"
	"time"
)

// stampArrivals: receive timestamps are read on Linux only.
func stampArrivals(*net.UDPConn) bool { return false }

func arrival([]byte) (time.Time, bool) { return time.Time{}, false }
