package testenv

import (
	"fmt"
	"net"
	"testing"
)

func TestFreePort(t *testing.T) {
	lo := ephemeralLow()
	seen := map[int]bool{}
	for range 50 {
		p := FreePort(t)
		if p < lowestPort || p >= lo {
			t.Fatalf("FreePort = %d, want in [%d, %d): below the ephemeral range", p, lowestPort, lo)
		}
		if seen[p] {
			t.Fatalf("FreePort handed out %d twice", p)
		}
		seen[p] = true
		addr := fmt.Sprintf("127.0.0.1:%d", p)
		u, err := net.ListenPacket("udp", addr)
		if err != nil {
			t.Fatalf("bind udp %s: %v", addr, err)
		}
		l, err := net.Listen("tcp", addr)
		u.Close()
		if err != nil {
			t.Fatalf("bind tcp %s: %v", addr, err)
		}
		l.Close()
	}
}
