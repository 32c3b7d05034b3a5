package egresspolicy

import (
	"cmp"
	"slices"
	"strings"
)

// ports is what one name entry opens: any port, or a sorted set.
type ports struct {
	any bool
	set []Port
}

func (p ports) union(q ports) ports {
	if p.any || q.any {
		return ports{any: true}
	}
	out := append(slices.Clone(p.set), q.set...)
	slices.SortFunc(out, comparePorts)
	return ports{set: slices.Compact(out)}
}

func comparePorts(a, b Port) int {
	if c := cmp.Compare(a.Port, b.Port); c != 0 {
		return c
	}
	return cmp.Compare(a.Protocol, b.Protocol)
}

// index is a policy's names compiled for Allows: exact names and wildcard
// domains (the part after "*."), both normalized, each with its ports.
type index struct {
	exact map[string]ports
	wild  map[string]ports
}

func (ix *index) add(rules []Rule) {
	if ix.exact == nil {
		ix.exact, ix.wild = map[string]ports{}, map[string]ports{}
	}
	for _, r := range rules {
		ps := ports{any: len(r.Ports) == 0}
		if !ps.any {
			ps = ps.union(ports{set: r.Ports}) // sorted, deduplicated copy
		}
		for _, n := range r.Names {
			m, key := ix.exact, normalize(n)
			if rest, ok := strings.CutPrefix(key, "*."); ok {
				m, key = ix.wild, rest
			}
			if old, ok := m[key]; ok {
				ps = old.union(ps)
			}
			m[key] = ps
		}
	}
}

// Allows reports whether name may be resolved and then connected to, and
// on which ports: ok with nil ports is any port and protocol. Each match
// is one map lookup: the exact name, then each proper suffix of the name
// at a label boundary (so the cost follows the name's labels, not the
// policy's size). A name matched by several entries gets the union of
// their ports.
func (p *Policy) Allows(name string) (allowed []Port, ok bool) {
	if p == nil || p.ix.exact == nil {
		return nil, false
	}
	name = normalize(name)
	var got ports
	found := false
	if ps, hit := p.ix.exact[name]; hit {
		got, found = ps, true
	}
	if len(p.ix.wild) > 0 {
		for i := strings.IndexByte(name, '.'); i >= 0; {
			suffix := name[i+1:]
			if ps, hit := p.ix.wild[suffix]; hit {
				if found {
					got = got.union(ps)
				} else {
					got, found = ps, true
				}
			}
			j := strings.IndexByte(suffix, '.')
			if j < 0 {
				break
			}
			i += j + 1
		}
	}
	if !found {
		return nil, false
	}
	if got.any {
		return nil, true
	}
	return got.set, true
}
