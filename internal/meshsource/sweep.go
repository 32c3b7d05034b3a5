package meshsource

import (
	"net/netip"
	"strings"
	"sync"

	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// sweeper lets a source restart its watches (a new kubeconfig, another
// served version of a CRD, the CRD gone) without its names going away in
// between: each restart is a generation that delivers its objects through
// the same sink, and when it has synced, the keys the previous generations
// contributed and it did not are removed (objects deleted while nobody
// watched). Until then the last state keeps serving. Calls of a generation
// that is no longer the current one are dropped.
type sweeper struct {
	sink names.Sink

	mu      sync.Mutex
	gen     int
	live    map[string]bool // keys that have hosts or clients in the store
	touched map[string]bool // keys the current generation delivered, until it synced
}

func newSweeper(sink names.Sink) *sweeper {
	return &sweeper{sink: sink, live: map[string]bool{}}
}

// next starts a generation and returns its sink.
func (s *sweeper) next() names.Sink {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.gen++
	s.touched = map[string]bool{}
	return &genSink{s: s, gen: s.gen}
}

// genSink is one generation's sink.
type genSink struct {
	s   *sweeper
	gen int
}

// lock takes the sweeper's lock if the generation is current.
func (g *genSink) lock() bool {
	g.s.mu.Lock()
	if g.s.gen != g.gen {
		g.s.mu.Unlock()
		return false
	}
	return true
}

func (g *genSink) note(key string, has bool) {
	if g.s.touched != nil {
		g.s.touched[key] = true
	}
	if has {
		g.s.live[key] = true
	} else {
		delete(g.s.live, key)
	}
}

func (g *genSink) Set(key string, hosts []nametable.Host) error {
	if !g.lock() {
		return nil
	}
	defer g.s.mu.Unlock()
	g.note(key, len(hosts) > 0)
	return g.s.sink.Set(key, hosts)
}

// Clients share the keys' namespace with hosts: a source uses distinct
// keys for the two (Services vs Pods), so a key is live if it has either.
func (g *genSink) SetClients(key string, ips []netip.Addr, namespace string) error {
	if !g.lock() {
		return nil
	}
	defer g.s.mu.Unlock()
	g.note("client\x00"+key, len(ips) > 0)
	return g.s.sink.SetClients(key, ips, namespace)
}

// Apply changes several keys at once, as for a plain sink.
func (g *genSink) Apply(c *nametable.Change) error {
	if !g.lock() {
		return nil
	}
	defer g.s.mu.Unlock()
	if err := g.s.sink.Apply(c); err != nil {
		return err
	}
	for _, e := range c.Set {
		g.note(e.Key, true)
	}
	for _, k := range c.Gone {
		g.note(k, false)
	}
	if c.ClientsChanged {
		for k := range g.s.live {
			if strings.HasPrefix(k, "client\x00") {
				g.note(k, false)
			}
		}
		for ip := range c.Clients {
			g.note("client\x00"+ip.String(), true)
		}
	}
	return nil
}

// Load replaces everything the source contributes, as for a plain sink.
func (g *genSink) Load(hosts map[string]nametable.Host, clients map[netip.Addr]string) error {
	if !g.lock() {
		return nil
	}
	defer g.s.mu.Unlock()
	if err := g.s.sink.Load(hosts, clients); err != nil {
		return err
	}
	clear(g.s.live)
	for k := range hosts {
		g.note(k, true)
	}
	for ip := range clients {
		g.note("client\x00"+ip.String(), true)
	}
	return nil
}

// Audit removes what earlier generations delivered and this one did not
// (as Synced does), so that the store's count is this generation's, then
// audits.
func (g *genSink) Audit(expected int) error {
	if !g.lock() {
		return nil
	}
	defer g.s.mu.Unlock()
	g.sweepLocked()
	return g.s.sink.Audit(expected)
}

// Synced removes what earlier generations delivered and this one did not,
// then marks the source synced (the store counts only the first time).
func (g *genSink) Synced() {
	if !g.lock() {
		return
	}
	defer g.s.mu.Unlock()
	g.sweepLocked()
	g.s.touched = nil
	g.s.sink.Synced()
}

// sweepLocked removes the keys earlier generations delivered and the
// current one has not; g.s.mu is held.
func (g *genSink) sweepLocked() {
	if g.s.touched == nil {
		return
	}
	for k := range g.s.live {
		if g.s.touched[k] {
			continue
		}
		delete(g.s.live, k)
		if ck, ok := strings.CutPrefix(k, "client\x00"); ok {
			_ = g.s.sink.SetClients(ck, nil, "")
		} else {
			_ = g.s.sink.Set(k, nil)
		}
	}
}

// Failed reports the origin's health (the current generation's only).
func (g *genSink) Failed(err error) {
	if !g.lock() {
		return
	}
	defer g.s.mu.Unlock()
	g.s.sink.Failed(err)
}
