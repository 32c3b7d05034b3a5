package nametable

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
)

// Change is a batch of one source's changes that is applied as one table
// change (Builder.Apply; the name store's Sink.Apply): keys that get one
// host each, keys that are gone, and, when ClientsChanged, the source's
// clients.
type Change struct {
	// Set are the keys that are new or changed, each with its one host.
	// The Builder takes the hosts as they are (it normalises them in
	// place): the caller must neither change nor reuse them.
	Set []KeyHost
	// Gone are keys that no longer have hosts.
	Gone []string
	// Clients become the source's clients (pod IP -> namespace) when
	// ClientsChanged.
	Clients        map[netip.Addr]string
	ClientsChanged bool

	checked bool // by Check
	next    int  // Gone and Set entries applied so far
	done    bool
}

// KeyHost is one key of a Change and its host.
type KeyHost struct {
	Key  string
	Host *Host
}

// Keys lists the change's keys, sorted: "k" for a key set, "-k" for one
// that is gone (for logs and tests).
func (c *Change) Keys() []string {
	out := make([]string, 0, len(c.Set)+len(c.Gone))
	for _, e := range c.Set {
		out = append(out, e.Key)
	}
	for _, k := range c.Gone {
		out = append(out, "-"+k)
	}
	slices.Sort(out)
	return out
}

// Empty says whether the change changes nothing.
func (c *Change) Empty() bool { return len(c.Set) == 0 && len(c.Gone) == 0 && !c.ClientsChanged }

// Load replaces everything a source contributes with hosts (one per key)
// and clients: keys that are gone are removed, hosts that did not change
// stay untouched. All hosts are validated first; on error nothing changes.
func (b *Builder) Load(source string, hosts map[string]Host, clients map[netip.Addr]string) error {
	c := &Change{Clients: clients, ClientsChanged: true}
	for key := range b.keys[source].keys() {
		if _, ok := hosts[key]; !ok {
			c.Gone = append(c.Gone, key)
		}
	}
	c.Set = make([]KeyHost, 0, len(hosts))
	for _, k := range slices.Sorted(maps.Keys(hosts)) {
		h := new(Host)
		*h = hosts[k]
		c.Set = append(c.Set, KeyHost{k, h})
	}
	return b.Apply(source, c)
}

// Apply checks c and applies all of it (Check, then ApplySome).
func (b *Builder) Apply(source string, c *Change) error {
	if err := b.Check(source, c); err != nil {
		return err
	}
	b.ApplySome(source, c, len(c.Gone)+len(c.Set))
	return nil
}

// Check validates a change of source: its hosts (normalised in place) and
// clients. It changes nothing in the Builder, and a change that passed it
// applies without an error.
func (b *Builder) Check(source string, c *Change) error {
	if _, ok := b.sources[source]; !ok {
		return fmt.Errorf("nametable: unknown source %q", source)
	}
	for _, e := range c.Set {
		name := e.Host.Name
		if err := b.normalize(e.Host); err != nil {
			return fmt.Errorf("%s: host %q: %w", e.Key, name, err)
		}
	}
	if c.ClientsChanged {
		for ip, ns := range c.Clients {
			if !isLabel(strings.ToLower(ns)) {
				return fmt.Errorf("client %s: namespace %q is not a single DNS label", ip, ns)
			}
		}
	}
	c.checked = true
	return nil
}

// ApplySome applies up to n more entries of a checked change of source
// (the gone keys first, then the set ones, in order) and, with the last,
// its clients. It reports whether the change is now fully applied. A
// change applied in several calls must not be published in between: until
// then the table would hold part of it.
func (b *Builder) ApplySome(source string, c *Change, n int) bool {
	if !c.checked {
		panic("nametable: ApplySome of a change that was not checked")
	}
	if c.next == 0 && b.keys[source].len() == 0 && len(c.Set) > 0 {
		b.keys[source] = newObjects(len(c.Set)) // a first load: sized once
	}
	for ; n > 0 && c.next < len(c.Gone)+len(c.Set); n-- {
		if c.next < len(c.Gone) {
			_ = b.Set(source, c.Gone[c.next], nil)
		} else {
			e := c.Set[c.next-len(c.Gone)]
			b.adopt(source, e.Key, e.Host)
		}
		c.next++
	}
	if c.next < len(c.Gone)+len(c.Set) {
		return false
	}
	if !c.done && c.ClientsChanged {
		b.replaceClients(source, c.Clients)
	}
	c.done = true
	return true
}

// adopt makes h, normalised, the one host of the source's key. The
// Builder owns h from now on. An unchanged host stays as it is (no table
// change).
func (b *Builder) adopt(source, key string, h *Host) {
	skeys := b.keys[source]
	var buf [1]*Host
	old := skeys.hosts(key, &buf)
	h.src, h.key = b.sources[source], key
	if len(old) == 1 && sameHost(old[0], h) {
		return
	}
	b.begin()
	for _, o := range old {
		b.unlink(o)
	}
	b.link(h)
	skeys.setOne(key, h)
}
