package ndssource

import (
	"log/slog"
	"slices"

	nds "istio.io/istio/pkg/dns/proto"

	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// merger turns the tables of the views into the source's hosts: per name,
// one host per distinct content, visible to the namespaces whose view has
// it, or to every client when every view has it alike. Only Run's
// goroutine uses it, and what it sets for a name depends only on the
// views' current tables, never on the order they arrived in.
type merger struct {
	sink   names.Sink
	domain string
	log    *slog.Logger
	views  map[string]*viewTable
	intern map[string]*variant
	set    map[string]struct{} // names the store has hosts of
}

type viewTable struct {
	names map[string]*variant // nil until the view's first table
	tried bool                // a table arrived or the stream failed
}

func newMerger(sink names.Sink, domain string, log *slog.Logger) *merger {
	return &merger{sink: sink, domain: domain, log: log,
		views: map[string]*viewTable{}, intern: map[string]*variant{}, set: map[string]struct{}{}}
}

func (m *merger) want(ns string) {
	if m.views[ns] == nil {
		m.views[ns] = &viewTable{}
	}
}

func (m *merger) tried(ns string) {
	if v := m.views[ns]; v != nil {
		v.tried = true
	}
}

// initialDone reports whether every view has a table or has failed once,
// and the view of own has a table.
func (m *merger) initialDone(own string) bool {
	if v := m.views[own]; v == nil || v.names == nil {
		return false
	}
	for _, v := range m.views {
		if !v.tried {
			return false
		}
	}
	return true
}

func (m *merger) names() int { return len(m.set) }

// apply replaces the table of view ns and updates the names that changed;
// all names when this is the view's first table (the set of views that
// every-client hosts must be in grew).
func (m *merger) apply(ns string, t *nds.NameTable) {
	v := m.views[ns]
	if v == nil {
		return
	}
	v.tried = true
	first := v.names == nil
	next := make(map[string]*variant, len(t.GetTable()))
	for name, info := range t.GetTable() {
		if info == nil {
			continue
		}
		if old := v.names[name]; old != nil && sameInfo(old.info, info) {
			old.refs++
			next[name] = old
			continue
		}
		next[name] = m.hold(name, info)
	}
	var changed []string
	if !first {
		for name, vr := range next {
			if v.names[name] != vr {
				changed = append(changed, name)
			}
		}
		for name := range v.names {
			if _, ok := next[name]; !ok {
				changed = append(changed, name)
			}
		}
	}
	old := v.names
	v.names = next
	for _, vr := range old {
		m.release(vr)
	}
	if first {
		m.recomputeAll()
		return
	}
	slices.Sort(changed)
	for _, name := range changed {
		m.recompute(name)
	}
}

// drop forgets view ns (no Pod of its namespace is left on the node).
func (m *merger) drop(ns string) {
	v := m.views[ns]
	if v == nil {
		return
	}
	delete(m.views, ns)
	for _, vr := range v.names {
		m.release(vr)
	}
	if v.names != nil {
		m.recomputeAll()
	}
}

func (m *merger) hold(name string, info *nds.NameTable_NameInfo) *variant {
	key := name + "\x00" + fingerprint(info)
	vr := m.intern[key]
	if vr == nil {
		vr = &variant{key: key, info: info, host: hostOf(name, info, m.domain)}
		m.intern[key] = vr
	}
	vr.refs++
	return vr
}

func (m *merger) release(vr *variant) {
	if vr.refs--; vr.refs <= 0 {
		delete(m.intern, vr.key)
	}
}

// synced lists the views that have a table, by namespace.
func (m *merger) synced() []string {
	var out []string
	for ns, v := range m.views {
		if v.names != nil {
			out = append(out, ns)
		}
	}
	slices.Sort(out)
	return out
}

func (m *merger) recomputeAll() {
	all := map[string]struct{}{}
	for name := range m.set {
		all[name] = struct{}{}
	}
	for _, v := range m.views {
		for name := range v.names {
			all[name] = struct{}{}
		}
	}
	sorted := make([]string, 0, len(all))
	for name := range all {
		sorted = append(sorted, name)
	}
	slices.Sort(sorted)
	views := m.synced()
	for _, name := range sorted {
		m.setName(name, views)
	}
}

func (m *merger) recompute(name string) { m.setName(name, m.synced()) }

// setName gives the store the hosts of name: one per distinct content
// among the views, visible to the namespaces of the views that have it,
// or to everyone when all views have it.
func (m *merger) setName(name string, views []string) {
	var order []*variant
	vis := map[*variant][]string{}
	for _, ns := range views {
		vr := m.views[ns].names[name]
		if vr == nil {
			continue
		}
		if _, ok := vis[vr]; !ok {
			order = append(order, vr)
		}
		vis[vr] = append(vis[vr], ns)
	}
	hosts := make([]nametable.Host, 0, len(order))
	for _, vr := range order {
		h := vr.host
		if len(vis[vr]) < len(views) {
			var x nametable.HostExtra // vr.host's Extra is shared: a copy
			if h.Extra != nil {
				x = *h.Extra
			}
			x.Visible = vis[vr]
			h.Extra = &x
		}
		hosts = append(hosts, h)
	}
	if len(hosts) == 0 {
		delete(m.set, name)
	} else {
		m.set[name] = struct{}{}
	}
	if err := m.sink.Set(name, hosts); err != nil {
		m.log.Warn("istiod name not answered", "name", name, "err", err)
	}
}
