package nametable

// The Builder's indexes beside the names: the reverse (PTR) index of
// addresses, the empty non-terminals of the cluster domain, the short names
// of Kubernetes Services and the bare names they give, and the count of
// hosts. setEntry keeps them in step with the published entries.

import (
	"net/netip"
	"slices"
)

// shortRec counts the namespaces that have a Kubernetes Service of one
// short name: ns/n while there is only one, more when there are several.
type shortRec struct {
	ns   string
	n    int32
	more map[string]int32
}

// index adds (d = +1) or takes out (d = -1) the canonical entry of host h
// (named x) in the counts and the reverse and empty-non-terminal indexes.
func (b *Builder) index(x string, h *Host, d int32) {
	b.hosts += int(d)
	if h.Wildcard {
		return
	}
	if !h.NoPTR {
		ptr := b.ptrAdd
		if d < 0 {
			ptr = b.ptrDel
		}
		for _, a := range h.V4 {
			ptr(a, x)
		}
		for _, a := range h.V6 {
			ptr(a, x)
		}
	}
	if h.inDomain {
		b.entAdd(x, d)
	}
	if h.shortLen > 0 {
		b.shortAdd(h.shortLabel(), h.Namespace(), d)
	}
}

func (b *Builder) ptrAdd(addr netip.Addr, x string) {
	a := keyOf(addr)
	cur, _ := b.w.ptr.get(a)
	names := cur.list()
	i, found := slices.BinarySearch(names, x)
	if found {
		return
	}
	b.w.ptr.set(a, newPtrNames(slices.Insert(slices.Clone(names), i, x)))
}

func (b *Builder) ptrDel(addr netip.Addr, x string) {
	a := keyOf(addr)
	cur, _ := b.w.ptr.get(a)
	names := cur.list()
	i, found := slices.BinarySearch(names, x)
	if !found {
		return
	}
	if len(names) == 1 {
		b.w.ptr.del(a)
		return
	}
	b.w.ptr.set(a, newPtrNames(slices.Delete(slices.Clone(names), i, i+1)))
}

// entAdd counts x below each of its ancestors under (not including) the
// cluster domain.
func (b *Builder) entAdd(x string, delta int32) {
	for i := 0; i < len(x)-len(b.domain)-1; i++ {
		if x[i] != '.' {
			continue
		}
		anc := x[i+1:]
		if anc == b.domain {
			break
		}
		n := b.ents[anc] + delta
		switch {
		case n <= 0:
			delete(b.ents, anc)
			b.w.ents.del(anc)
		case n == delta:
			b.ents[anc] = n
			b.w.ents.set(anc, struct{}{})
		default:
			b.ents[anc] = n
		}
	}
}

func (b *Builder) shortAdd(label, ns string, delta int32) {
	r, ok := b.shorts[label]
	switch {
	case !ok:
		if delta > 0 {
			b.shorts[label] = shortRec{ns: ns, n: delta}
		}
		return
	case r.more == nil && r.ns == ns:
		if r.n += delta; r.n <= 0 {
			delete(b.shorts, label)
		} else {
			b.shorts[label] = r
		}
		return
	case r.more == nil:
		r.more = map[string]int32{r.ns: r.n}
	}
	if r.more[ns] += delta; r.more[ns] <= 0 {
		delete(r.more, ns)
	}
	switch len(r.more) {
	case 0:
		delete(b.shorts, label)
		return
	case 1:
		for k, v := range r.more {
			r.ns, r.n = k, v
		}
		r.more = nil
	}
	b.shorts[label] = r
}

// refreshBare keeps the bare name "<short>." pointing at the Service of
// the only namespace that has it, or absent when none or several do.
func (b *Builder) refreshBare(label string) {
	r, ok := b.shorts[label]
	if !ok || r.more != nil {
		b.w.bare.del(label)
		return
	}
	e, _ := b.w.names.get(label + r.ns + b.svc)
	if e == nil {
		b.w.bare.del(label)
		return
	}
	if cur, _ := b.w.bare.get(label); cur != e {
		b.w.bare.set(label, e)
	}
}
