package nametable

import (
	"iter"
	"maps"
)

// objects are one source's object keys and their hosts. Most keys have one
// host (a Service, a file entry): those are a map of pointers, a smaller
// map slot than a slice's and no slice each. The few with more (a headless
// Service's endpoints) are in a map of their own.
type objects struct {
	one  map[string]*Host
	many map[string][]*Host // keys with two hosts or more
}

func newObjects(n int) *objects {
	return &objects{one: make(map[string]*Host, n), many: map[string][]*Host{}}
}

// len is the number of keys (0 for nil, an unknown source's).
func (o *objects) len() int {
	if o == nil {
		return 0
	}
	return len(o.one) + len(o.many)
}

// hosts returns key's hosts; buf holds a key's one host, so that looking
// it up allocates nothing. The slice is the caller's to read, not to keep.
func (o *objects) hosts(key string, buf *[1]*Host) []*Host {
	if h, ok := o.one[key]; ok {
		buf[0] = h
		return buf[:]
	}
	return o.many[key]
}

// set makes hosts key's hosts (none removes the key). The objects keep
// a slice of two hosts or more.
func (o *objects) set(key string, hosts []*Host) {
	switch len(hosts) {
	case 0:
		delete(o.one, key)
		delete(o.many, key)
	case 1:
		delete(o.many, key)
		o.one[key] = hosts[0]
	default:
		delete(o.one, key)
		o.many[key] = hosts
	}
}

// setOne makes h key's one host.
func (o *objects) setOne(key string, h *Host) {
	delete(o.many, key)
	o.one[key] = h
}

// keys are the keys, in no order (none for nil); they may be set while
// iterated.
func (o *objects) keys() iter.Seq[string] {
	return func(yield func(string) bool) {
		if o == nil {
			return
		}
		for k := range maps.Keys(o.one) {
			if !yield(k) {
				return
			}
		}
		for k := range maps.Keys(o.many) {
			if !yield(k) {
				return
			}
		}
	}
}
