//go:build !linux

package resolver

import "net"

// Outside Linux: one plain UDP socket per address, no packet info.
const reusePortSupported = false

func listenConfig() net.ListenConfig { return net.ListenConfig{} }

func setPktinfo(*net.UDPConn) bool { return false }

func replyPktinfo(_, _ []byte) []byte { return nil }
