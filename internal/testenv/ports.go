package testenv

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// lowestPort is where FreePort starts looking: above the well-known and most
// registered service ports a developer's machine may be running.
const lowestPort = 10000

var handedOut = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// FreePort returns a port on 127.0.0.1 that is free for both UDP and TCP, for a child
// process (an agent under test) to bind. It is picked below the kernel's ephemeral
// range, so the sockets that other tests, running beside us, bind to port 0 never take
// it before the child binds it; and no port is handed out twice by one test binary.
func FreePort(t testing.TB) int {
	t.Helper()
	hi := ephemeralLow()
	if hi <= lowestPort+100 {
		t.Fatalf("ephemeral port range starts at %d: no room below it for a test port", hi)
	}
	handedOut.Lock()
	defer handedOut.Unlock()
	for range 200 {
		p := lowestPort + rand.IntN(hi-lowestPort)
		if handedOut.ports[p] || !portFree(p) {
			continue
		}
		handedOut.ports[p] = true
		return p
	}
	t.Fatalf("no port free for both UDP and TCP on 127.0.0.1 in [%d, %d)", lowestPort, hi)
	return 0
}

// portFree reports whether 127.0.0.1:p can be bound for both UDP and TCP right now.
func portFree(p int) bool {
	addr := fmt.Sprintf("127.0.0.1:%d", p)
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		return false
	}
	defer u.Close()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// ephemeralLow is the first port of the kernel's ephemeral range (32768 when it
// cannot be read).
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 32768
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return lo
}
