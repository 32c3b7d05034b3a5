package testenv

import (
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// FakeDNS is a fake nameserver for tests (internal/dnsfake) that answers the names in
// its records (A or AAAA by the address family) and NXDOMAIN with an SOA for everything
// else, over UDP and TCP, and records every query it sees. It stands for "the original
// nameserver" or an upstream; it never forwards anywhere.
type FakeDNS struct {
	*dnsfake.Server
	Addr string // host:port it serves on

	mu      sync.Mutex
	records map[string][]netip.Addr
}

// Query is one query a FakeDNS saw.
type Query = dnsfake.Query

// StartFakeDNS serves on addr ("ip:port"; port 0 picks one, the same for UDP and
// TCP) inside ns (nil: the test's own namespace) until the test ends.
func StartFakeDNS(t testing.TB, ns *Netns, addr string, records map[string][]netip.Addr) *FakeDNS {
	t.Helper()
	f := &FakeDNS{records: map[string][]netip.Addr{}}
	for name, ips := range records {
		f.records[dns.CanonicalName(name)] = ips
	}
	listen := func() error {
		s, err := dnsfake.Listen(dnsfake.Config{Addr: addr, Respond: dnsfake.Records(5, f.lookup)})
		if err != nil {
			return err
		}
		f.Server = s
		return nil
	}
	var err error
	if ns != nil {
		err = ns.Do(listen)
	} else {
		err = listen()
	}
	if err != nil {
		t.Fatalf("start fake DNS on %s: %v", addr, err)
	}
	f.Addr = f.Server.Addr.String()
	t.Cleanup(f.Close)
	return f
}

func (f *FakeDNS) lookup(name string) ([]netip.Addr, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ips, ok := f.records[name]
	return ips, ok
}

// Set replaces the addresses of one name.
func (f *FakeDNS) Set(name string, ips ...netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.records[dns.CanonicalName(name)] = ips
}

// Count returns how many queries for name (any type) were seen.
func (f *FakeDNS) Count(name string) int {
	name = dns.CanonicalName(name)
	n := 0
	for _, q := range f.Queries() {
		if q.Name == name {
			n++
		}
	}
	return n
}

// WaitFor polls cond every 20 ms until it holds or timeout passes.
func WaitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}
