package overload

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// quietNames is the quiet workload's mix: a table name and three external names in
// turn.
var quietNames = []string{meshName, "ext1.example.org.", meshName, "ext2.example.org.", meshName, "ext3.example.org."}

// nxName is the noisy workload's name of query i: a unique name under nx.test.
func nxName(i int) string { return fmt.Sprintf("n%d-%d.nx.test.", i, rand.Uint32()) }

// load is the overload tests' two workloads against an agent: a noisy one sending
// 20,000 queries a second from 127.0.0.1 (none when its names are nil) and a quiet
// one asking quietNames one at a time, 5 ms apart, from 127.0.0.2.
type load struct {
	done  chan struct{}
	noisy chan *dnsfake.Paced // nil without a noisy workload
	quiet chan *dnsfake.Probe
}

// startLoad starts the workloads; noisyName names the noisy workload's i-th query.
func startLoad(t *testing.T, a *agent, noisyName func(i int) string) *load {
	t.Helper()
	l := &load{done: make(chan struct{}), quiet: make(chan *dnsfake.Probe, 1)}
	if noisyName != nil {
		l.noisy = make(chan *dnsfake.Paced, 1)
		go func() {
			p, err := dnsfake.PacedUDP(netip.MustParseAddrPort(a.dnsAddr), netip.MustParseAddr("127.0.0.1"), 20000, noisyName, l.done)
			if err != nil {
				t.Error(err)
			}
			l.noisy <- p
		}()
	}
	go func() {
		p, err := dnsfake.MixProber(a.dnsAddr, netip.MustParseAddr("127.0.0.2"), quietNames, 5*time.Second, 5*time.Millisecond, l.done)
		if err != nil {
			t.Error(err)
		}
		l.quiet <- p
	}()
	return l
}

// stop ends both workloads and returns what each saw (the noisy one's nil
// without it, or when it failed to start; the quiet one's nil when it failed).
func (l *load) stop() (*dnsfake.Paced, *dnsfake.Probe) {
	close(l.done)
	var n *dnsfake.Paced
	if l.noisy != nil {
		n = <-l.noisy
	}
	return n, <-l.quiet
}
