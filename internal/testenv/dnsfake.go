//go:build linux

package testenv

import (
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// FakeDNS is a fake nameserver for tests (internal/dnsfake) that answers the names in
// its records (A or AAAA by the address family; "*.zone" answers every name one label
// below zone) and NXDOMAIN with an SOA for everything else, over UDP and TCP, and
// records every query it sees. It stands for "the original nameserver" or an upstream;
// it never forwards anywhere.
type FakeDNS struct {
	*dnsfake.Server
	Addr string // host:port it serves on

	mu      sync.Mutex
	records map[string][]netip.Addr
	delays  map[string]time.Duration
	silent  map[string]bool
	fresh   map[string]*freshName
}

// Query is one query a FakeDNS saw.
type Query = dnsfake.Query

// StartFakeDNS serves on addr ("ip:port"; port 0 picks one, the same for UDP and
// TCP) inside ns (nil: the test's own namespace) until the test ends.
func StartFakeDNS(t testing.TB, ns *Netns, addr string, records map[string][]netip.Addr) *FakeDNS {
	t.Helper()
	f := &FakeDNS{records: map[string][]netip.Addr{}, delays: map[string]time.Duration{}, silent: map[string]bool{}, fresh: map[string]*freshName{}}
	for name, ips := range records {
		f.records[dns.CanonicalName(name)] = ips
	}
	listen := func() error {
		answer := dnsfake.Records(5, f.lookup)
		s, err := dnsfake.Listen(dnsfake.Config{Addr: addr, Respond: func(proto string, req *dns.Msg) []*dns.Msg {
			if len(req.Question) == 1 && f.isSilent(req.Question[0].Name) {
				return nil // a black hole: the query is recorded, never answered
			}
			if m, ok := f.freshAnswer(req); ok {
				return []*dns.Msg{m}
			}
			return answer(proto, req)
		}})
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

// lookup runs in the query's own goroutine: a name's delay holds up only its
// answer.
func (f *FakeDNS) lookup(name string) ([]netip.Addr, bool) {
	f.mu.Lock()
	ips, ok := f.records[name]
	delay := f.delays[name]
	if !ok {
		// "*.zone" records answer every name under zone.
		if _, zone, found := strings.Cut(name, "."); found {
			ips, ok = f.records["*."+zone]
			delay = f.delays["*."+zone]
		}
	}
	f.mu.Unlock()
	if delay > 0 {
		time.Sleep(delay) // the upstream is slow for this name
	}
	return ips, ok
}

// Set replaces the addresses of one name.
func (f *FakeDNS) Set(name string, ips ...netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.records[dns.CanonicalName(name)] = ips
}

// SetNameDelay makes the server wait d before answering name ("*.zone": every
// name under zone; 0: answer at once).
func (f *FakeDNS) SetNameDelay(name string, d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.delays[dns.CanonicalName(name)] = d
}

// SetNameSilent makes the server never answer name ("*.zone": every name
// under zone), as an upstream that drops a zone's queries; it still records
// them.
func (f *FakeDNS) SetNameSilent(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.silent[dns.CanonicalName(name)] = true
}

func (f *FakeDNS) isSilent(name string) bool {
	name = dns.CanonicalName(name)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.silent[name] {
		return true
	}
	_, zone, found := strings.Cut(name, ".")
	return found && f.silent["*."+zone]
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
