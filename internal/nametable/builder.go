package nametable

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/miekg/dns"
)

// Builder keeps the hosts every source contributes, merges them, and
// publishes immutable Tables. A change touches only the names, addresses
// and shards it concerns: publishing after one changed host of a 100k-host
// table copies a few shards, it does not rebuild the table.
//
// Merge rules, for one name contributed by several hosts: a host's own
// (canonical) name beats an alternative name of another host; then the
// source with the higher priority wins; within a priority a host visible
// to some namespaces only comes before one visible to all; remaining ties
// go to the source name, the host name and the source's object key, in
// that order, so the result never depends on the order of updates. When the winner has Merge, every
// Merge host of that name (any source) answers together: the union of
// their addresses and ports. When the winner is visible only to some
// namespaces, clients of other namespaces get the next host they see.
//
// A Builder is not safe for concurrent use; the name store serialises it.
type Builder struct {
	domain, svc string // "cluster.local.", ".svc.cluster.local."
	ttl         uint32

	sources map[string]*sourceRec           // name -> the source and its priority
	keys    map[string]*objects             // source -> its object keys and their hosts
	clients map[string]map[string]clientRec // source -> key -> client IPs
	multi   map[string][]*Host              // name -> contributors, when more than one
	shorts  map[string]shortRec             // "<short>." -> namespaces having it
	ents    map[string]int32                // empty non-terminal -> names below it
	vips    vipAllocator
	pending []*Host // hosts waiting for a VIP

	hosts, skipped int
	serial         uint32
	clientsDirty   bool

	base *Table // last published
	open bool   // a batch is open: the writers hold changes not yet published
	w    struct {
		names, wildcards, bare smapWriter[string, *Name]
		ents                   smapWriter[string, struct{}]
		ptr                    smapWriter[addrKey, ptrNames]
	}
}

type clientRec struct {
	ips []netip.Addr
	ns  string
}

// NewBuilder returns an empty Builder.
func NewBuilder(opts Options) (*Builder, error) {
	opts = opts.withDefaults()
	domain := strings.ToLower(strings.Trim(opts.ClusterDomain, "."))
	if _, ok := dns.IsDomainName(domain); !ok || domain == "" || strings.ContainsAny(domain, "*\\ ") {
		return nil, fmt.Errorf("cluster domain %q is not a domain name", opts.ClusterDomain)
	}
	domain += "."
	ttl := uint32(opts.TTL / time.Second)
	if ttl == 0 {
		ttl = 1
	}
	b := &Builder{
		domain:  domain,
		svc:     ".svc." + domain,
		ttl:     ttl,
		sources: map[string]*sourceRec{},
		keys:    map[string]*objects{},
		clients: map[string]map[string]clientRec{},
		multi:   map[string][]*Host{},
		shorts:  map[string]shortRec{},
		ents:    map[string]int32{},
		vips:    newVIPAllocator(),
	}
	b.base = &Table{
		names:     newSmap[string, *Name](),
		wildcards: newSmap[string, *Name](),
		bare:      newSmap[string, *Name](),
		ents:      newSmap[string, struct{}](),
		ptr:       newSmap[addrKey, ptrNames](),
		domain:    domain,
		svc:       b.svc,
		ttl:       ttl,
	}
	b.base.soa = b.newSOA(domain, 0)
	return b, nil
}

// Domain is the cluster domain, lower case with the trailing dot.
func (b *Builder) Domain() string { return b.domain }

// AddSource registers a source and its priority (higher wins).
func (b *Builder) AddSource(name string, priority int) {
	if r := b.sources[name]; r != nil {
		r.prio = priority // the tables only read the name
	} else {
		b.sources[name] = &sourceRec{name: name, prio: priority}
	}
	if b.keys[name] == nil {
		b.keys[name] = newObjects(0)
		b.clients[name] = map[string]clientRec{}
	}
}

// Objects is the number of object keys a source contributes hosts for.
func (b *Builder) Objects(source string) int { return b.keys[source].len() }

// Set replaces the hosts the source's object key contributes; no hosts
// removes the key. The Host values are copied, but the table may keep
// their slices (addresses, ports, names): a source must not change them
// after the call. A host that fails validation is an error and nothing
// changes.
func (b *Builder) Set(source, key string, hosts []Host) error {
	if _, ok := b.sources[source]; !ok {
		return fmt.Errorf("nametable: unknown source %q", source)
	}
	nh := make([]*Host, 0, len(hosts))
	for i := range hosts {
		h := new(Host)
		*h = hosts[i]
		if err := b.normalize(h); err != nil {
			return fmt.Errorf("host %q: %w", hosts[i].Name, err)
		}
		h.src, h.key = b.sources[source], key
		nh = append(nh, h)
	}
	skeys := b.keys[source]
	var buf [1]*Host
	old := skeys.hosts(key, &buf)
	if len(old) == 0 && len(nh) == 0 {
		return nil
	}
	b.begin()
	// Hosts that did not change stay as they are (same pointer, no table
	// change).
	kept := make([]bool, len(old))
	reused := make([]bool, len(nh))
	var byName map[string]int
	if len(old) > 8 {
		byName = make(map[string]int, len(old))
		for j := len(old) - 1; j >= 0; j-- {
			byName[old[j].Name] = j
		}
	}
	for i, h := range nh {
		if byName != nil {
			if j, ok := byName[h.Name]; ok && !kept[j] && sameHost(old[j], h) {
				kept[j], reused[i], nh[i] = true, true, old[j]
				continue
			}
		}
		for j, o := range old {
			if !kept[j] && o.Name == h.Name && sameHost(o, h) {
				kept[j], reused[i], nh[i] = true, true, o
				break
			}
		}
	}
	for j, o := range old {
		if !kept[j] {
			b.unlink(o)
		}
	}
	for i, h := range nh {
		if !reused[i] {
			b.link(h)
		}
	}
	skeys.set(key, nh)
	return nil
}

// SetClients records that the source's object key (a Pod) has these IPs
// in namespace ns; no IPs removes it. Between sources the higher priority
// wins.
func (b *Builder) SetClients(source, key string, ips []netip.Addr, ns string) error {
	m, ok := b.clients[source]
	if !ok {
		return fmt.Errorf("nametable: unknown source %q", source)
	}
	ns = strings.ToLower(ns)
	if len(ips) > 0 && !isLabel(ns) {
		return fmt.Errorf("client %s: namespace %q is not a single DNS label", key, ns)
	}
	old, had := m[key]
	if len(ips) == 0 {
		if !had {
			return nil
		}
		delete(m, key)
	} else {
		u := make([]netip.Addr, len(ips))
		for i, ip := range ips {
			u[i] = ip.Unmap()
		}
		if had && old.ns == ns && slices.Equal(old.ips, u) {
			return nil
		}
		m[key] = clientRec{ips: u, ns: ns}
	}
	b.clientsDirty = true
	return nil
}

// RemoveSource drops everything a source contributed.
func (b *Builder) RemoveSource(source string) {
	for key := range b.keys[source].keys() {
		_ = b.Set(source, key, nil)
	}
	if len(b.clients[source]) > 0 {
		b.clientsDirty = true
	}
	delete(b.keys, source)
	delete(b.clients, source)
	delete(b.sources, source)
}

// Changed reports whether anything changed since the last Publish.
func (b *Builder) Changed() bool { return b.open || len(b.pending) > 0 || b.clientsDirty }

// Current is the last published table (empty before the first Publish).
func (b *Builder) Current() *Table { return b.base }

// Publish allocates the VIPs still pending and returns a new table with
// every change since the last Publish. Untouched shards are shared with
// the previous table. A VIP that cannot be allocated (the range is full)
// leaves that host out and is returned as an error; the table is
// published anyway.
func (b *Builder) Publish() (*Table, error) {
	var err error
	if len(b.pending) > 0 {
		b.begin()
		pend := b.pending
		b.pending = nil
		err = b.vips.allocate(pend)
		for _, h := range pend {
			if h.AutoVIP {
				b.linkNames(h)
			} else {
				b.skipped++
			}
		}
	}
	b.vips.sweep()
	if !b.open && !b.clientsDirty {
		return b.base, err
	}
	t := new(Table)
	*t = *b.base
	if b.open {
		t.names, t.wildcards, t.bare = b.w.names.m, b.w.wildcards.m, b.w.bare.m
		t.ents, t.ptr = b.w.ents.m, b.w.ptr.m
	}
	if b.clientsDirty {
		t.clients = b.mergeClients()
		b.clientsDirty = false
	}
	b.serial++
	t.serial = b.serial
	t.soa = b.newSOA(b.domain, b.serial)
	t.hosts, t.skipped = b.hosts, b.skipped
	b.base = t
	b.open = false
	return t, err
}

func (b *Builder) begin() {
	if b.open {
		return
	}
	b.open = true
	b.w.names.begin(b.base.names)
	b.w.wildcards.begin(b.base.wildcards)
	b.w.bare.begin(b.base.bare)
	b.w.ents.begin(b.base.ents)
	b.w.ptr.begin(b.base.ptr)
}

func (b *Builder) mergeClients() map[netip.Addr]string {
	type owner struct {
		ns   string
		prio int
	}
	best := map[netip.Addr]owner{}
	for src, m := range b.clients {
		p := b.sources[src].prio
		for _, r := range m {
			for _, ip := range r.ips {
				if o, ok := best[ip]; !ok || p > o.prio || (p == o.prio && r.ns < o.ns) {
					best[ip] = owner{r.ns, p}
				}
			}
		}
	}
	out := make(map[netip.Addr]string, len(best))
	for ip, o := range best {
		out[ip] = o.ns
	}
	return out
}

// link adds a new host's names (or queues it for a VIP).
func (b *Builder) link(h *Host) {
	if !h.HasData() && h.NeedVIP {
		if p, ok := b.vips.lease(h.Name); ok {
			h.V4, h.V6, h.AutoVIP = []netip.Addr{p.v4}, []netip.Addr{p.v6}, true
		} else {
			b.pending = append(b.pending, h)
			return
		}
	}
	if !h.HasData() {
		b.skipped++
		return
	}
	b.linkNames(h)
}

func (b *Builder) linkNames(h *Host) {
	h.linked = true
	h.self = Name{Host: h}
	if !h.inDomain && h.soa == nil {
		zone := strings.TrimPrefix(h.Name, "*.")
		h.soa = b.newSOA(zone, 1)
	}
	if !h.AutoVIP {
		b.vips.reserve(h, +1)
	}
	b.addName(h.Name, h)
	for _, alt := range h.AltNames() {
		b.addName(alt, h)
	}
}

// unlink removes a host's names.
func (b *Builder) unlink(h *Host) {
	if i := slices.Index(b.pending, h); i >= 0 {
		b.pending = slices.Delete(b.pending, i, i+1)
		return
	}
	if !h.linked {
		b.skipped--
		return
	}
	b.removeName(h.Name, h)
	for _, alt := range h.AltNames() {
		b.removeName(alt, h)
	}
	if h.AutoVIP {
		b.vips.release(h.Name)
	} else {
		b.vips.reserve(h, -1)
	}
	h.linked = false
}

func (b *Builder) entry(x string) *Name {
	var e *Name
	if strings.HasPrefix(x, "*.") {
		e, _ = b.w.wildcards.get(x[2:])
	} else {
		e, _ = b.w.names.get(x)
	}
	return e
}

func (b *Builder) addName(x string, h *Host) {
	list := b.multi[x]
	cur := b.entry(x)
	if list == nil && cur == nil {
		b.setEntry(x, b.single(x, h))
		return
	}
	if list == nil {
		list = []*Host{cur.Host} // a single contributor's entry holds that host
	}
	list = append(list, h)
	b.multi[x] = list
	b.setEntry(x, b.merge(x, list))
}

func (b *Builder) removeName(x string, h *Host) {
	list := b.multi[x]
	if list == nil {
		if cur := b.entry(x); cur != nil && cur.Host == h {
			b.setEntry(x, nil)
		}
		return
	}
	i := slices.Index(list, h)
	if i < 0 {
		return
	}
	list = slices.Delete(slices.Clone(list), i, i+1)
	switch len(list) {
	case 0:
		delete(b.multi, x)
		b.setEntry(x, nil)
	case 1:
		delete(b.multi, x)
		b.setEntry(x, b.single(x, list[0]))
	default:
		b.multi[x] = list
		b.setEntry(x, b.merge(x, list))
	}
}

// single is the entry of a name with one contributor.
func (b *Builder) single(x string, h *Host) *Name {
	if x == h.Name {
		return &h.self
	}
	return &Name{Host: h}
}

// merge computes the entry of a name with several contributors (see the
// rules on Builder).
func (b *Builder) merge(x string, list []*Host) *Name {
	sorted := slices.Clone(list)
	slices.SortFunc(sorted, func(p, q *Host) int {
		pa, qa := p.Name != x, q.Name != x
		if pa != qa {
			if pa {
				return 1
			}
			return -1
		}
		// Within a priority, a host visible to some namespaces only comes
		// before one visible to all: a client of such a namespace gets the
		// host exported to it (a ServiceEntry of its own namespace), every
		// other client the next one it sees.
		pn, qn := p.Visible() == nil, q.Visible() == nil
		vis := 0
		if pn != qn {
			vis = 1
			if qn {
				vis = -1
			}
		}
		return cmp.Or(cmp.Compare(q.src.prio, p.src.prio), vis, cmp.Compare(p.src.name, q.src.name),
			cmp.Compare(p.Name, q.Name), cmp.Compare(p.key, q.key))
	})
	win := sorted[0]
	rest := sorted[1:]
	if win.Merge && win.Name == x {
		var merged *Host
		rest = rest[:0:0]
		for _, h := range sorted[1:] {
			if !h.Merge || h.Name != x {
				rest = append(rest, h)
				continue
			}
			if merged == nil {
				merged = new(Host)
				*merged = *win
				merged.V4 = slices.Clone(win.V4)
				merged.V6 = slices.Clone(win.V6)
				merged.Ports = slices.Clone(win.Ports)
			}
			for _, a := range h.V4 {
				if !slices.Contains(merged.V4, a) {
					merged.V4 = append(merged.V4, a)
				}
			}
			for _, a := range h.V6 {
				if !slices.Contains(merged.V6, a) {
					merged.V6 = append(merged.V6, a)
				}
			}
			for _, p := range h.Ports {
				if !slices.Contains(merged.Ports, p) {
					merged.Ports = append(merged.Ports, p)
				}
			}
		}
		if merged != nil {
			merged.self = Name{Host: merged}
			win = merged
		}
	}
	head := &Name{Host: win}
	if win.Visible() == nil {
		if win.Name == x && win.self.Host == win {
			return &win.self
		}
		return head
	}
	// Clients that do not see the winner get the next host they see.
	tail := head
	seen := [][]string{win.Visible()}
	for _, h := range rest {
		vis := h.Visible()
		if vis != nil && slices.ContainsFunc(seen, func(v []string) bool { return slices.Equal(v, vis) }) {
			continue
		}
		tail.next = &Name{Host: h}
		tail = tail.next
		if vis == nil {
			break
		}
		seen = append(seen, vis)
	}
	return head
}

// setEntry publishes e as the entry of x (nil removes it) and keeps the
// reverse, empty-non-terminal and bare-name indexes in step.
func (b *Builder) setEntry(x string, e *Name) {
	wild := strings.HasPrefix(x, "*.")
	w := &b.w.names
	key := x
	if wild {
		w, key = &b.w.wildcards, x[2:]
	}
	old, _ := w.get(key)
	if old == e {
		return
	}
	if e == nil {
		w.del(key)
	} else {
		w.set(key, e)
	}
	if old != nil && old.Host.Name == x {
		b.index(x, old.Host, -1)
	}
	if e != nil && e.Host.Name == x {
		b.index(x, e.Host, +1)
	}
	for _, n := range []*Name{old, e} {
		if n != nil && n.Host.shortLen > 0 && n.Host.Name == x {
			b.refreshBare(n.Host.shortLabel())
			break
		}
	}
}

func (b *Builder) newSOA(zone string, serial uint32) *dns.SOA {
	return &dns.SOA{
		Hdr:     dns.RR_Header{Name: zone, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: b.ttl},
		Ns:      "ns.dns." + b.domain,
		Mbox:    "hostmaster." + b.domain,
		Serial:  serial,
		Refresh: 7200,
		Retry:   1800,
		Expire:  86400,
		Minttl:  b.ttl,
	}
}

// replaceClients makes clients the source's clients (validated).
func (b *Builder) replaceClients(source string, clients map[netip.Addr]string) {
	for key := range b.clients[source] {
		if ip, err := netip.ParseAddr(key); err != nil || clients[ip] == "" {
			_ = b.SetClients(source, key, nil, "")
		}
	}
	for ip, ns := range clients {
		_ = b.SetClients(source, ip.String(), []netip.Addr{ip}, ns)
	}
}

// HasClient reports whether the source's key has client IPs.
func (b *Builder) HasClient(source, key string) bool {
	_, ok := b.clients[source][key]
	return ok
}
