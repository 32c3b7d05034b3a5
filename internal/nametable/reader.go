package nametable

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"maps"
	"net/netip"
	"runtime"
	"strings"

	"sigs.k8s.io/yaml"
)

// Reader reads successive versions of one name table file and returns
// only what changed since the last version it was told was applied. It
// keeps a fingerprint of each entry's bytes, white space aside (about 80
// bytes per entry, with its key): an entry whose bytes did not change is
// neither copied, decoded nor validated again. The format and its checks
// are Parse's and File.Hosts's (docs/name-table.md).
//
// A Reader is not safe for concurrent use.
type Reader struct {
	domain  string
	svc     string // ".svc.<domain>."
	seed    maphash.Seed
	prints  map[string]entryPrint // the applied version's entries
	clients map[netip.Addr]string // the applied version's clients
	gen     uint32                // of the Read in progress or last done
	applied bool                  // a version was applied
}

// entryPrint is what a Reader remembers of an entry.
type entryPrint struct {
	sum uint64 // of the entry's bytes
	gen uint32 // the last Read that saw the key
	// name is the entry's normalized host name when it differs from the
	// key (upper case, a trailing dot); "" otherwise.
	name string
}

// Change is what a version of the file changes against the applied one.
type Change struct {
	// Set are the entries that are new or changed, Gone the keys that are
	// no longer there.
	Set  map[string]Host
	Gone []string
	// Clients are the file's clients when they changed (ClientsChanged).
	Clients        map[netip.Addr]string
	ClientsChanged bool
	// Entries is the number of table entries of the version.
	Entries int

	gen     uint32
	changed []changedPrint // the new prints of Set's keys
}

type changedPrint struct {
	key string
	p   entryPrint
}

// Empty says whether the version changes nothing.
func (c *Change) Empty() bool { return len(c.Set) == 0 && len(c.Gone) == 0 && !c.ClientsChanged }

// Reading costs: an entry is yielded on every yieldEvery (a reload on a
// busy core leaves the resolver's goroutines their turn every few tens of
// microseconds), and when more than 1/wholeFileShare of the entries
// changed, decoding the whole file at once is cheaper than each changed
// entry on its own.
const (
	yieldEvery     = 64
	wholeFileShare = 4
)

// NewReader returns a Reader for the cluster domain (for Kubernetes short
// names; "" is cluster.local).
func NewReader(domain string) *Reader {
	domain = strings.ToLower(strings.Trim(domain, "."))
	if domain == "" {
		domain = DefaultClusterDomain
	}
	return &Reader{domain: domain, svc: ".svc." + domain + ".", seed: maphash.MakeSeed(), prints: map[string]entryPrint{}}
}

// Read parses and validates a version of the file (JSON, or YAML) and
// returns its changes against the applied version. Nothing is remembered
// until Applied: a version that fails here, or that its consumer refuses,
// leaves the Reader as it was.
func (r *Reader) Read(data []byte) (*Change, error) {
	if t := bytes.TrimSpace(data); len(t) > 0 && t[0] != '{' {
		j, err := yaml.YAMLToJSON(data)
		if err != nil {
			return nil, err // "yaml: line N: ..."
		}
		data = j
	}
	r.gen++
	c := &Change{Set: map[string]Host{}, gen: r.gen}
	var pending []pendingEntry
	var clients []byte
	if t := bytes.TrimSpace(data); len(t) > 0 && string(t) != "null" {
		var err error
		if pending, clients, err = r.scan(data, c); err != nil {
			return nil, err
		}
	}
	if len(pending) > c.Entries/wholeFileShare {
		if err := r.decodeWhole(data, pending, c); err != nil {
			return nil, err
		}
	} else if err := r.decodeEach(data, pending, c); err != nil {
		return nil, err
	}
	if err := r.checkNames(c); err != nil {
		return nil, err
	}
	if err := r.readClients(clients, c); err != nil {
		return nil, err
	}
	for k, p := range r.prints {
		if p.gen != c.gen {
			c.Gone = append(c.Gone, k)
		}
	}
	return c, nil
}

// Applied records c, which its consumer applied, as the current version.
func (r *Reader) Applied(c *Change) {
	for _, k := range c.Gone {
		delete(r.prints, k)
	}
	for _, e := range c.changed {
		r.prints[e.key] = e.p
	}
	if c.ClientsChanged {
		r.clients = c.Clients
	}
	r.applied = true
}

// pendingEntry is a table entry whose bytes changed: where its value is.
type pendingEntry struct {
	key        string
	start, end int
	sum        uint64
}

// scan walks the file: the entries that did not change are marked seen,
// the others returned to be decoded; the clients' bytes are returned too.
func (r *Reader) scan(data []byte, c *Change) (pending []pendingEntry, clients []byte, err error) {
	s := &scanner{data: data}
	var h maphash.Hash
	h.SetSeed(r.seed)
	err = s.object(func(field []byte) error {
		switch string(field) {
		case "table":
			return s.object(func(key []byte) error {
				h.Reset()
				start, end, err := s.value(&h)
				if err != nil {
					return err
				}
				e, unchanged, err := r.entry(key, h.Sum64(), c)
				if err != nil {
					return err
				}
				if !unchanged {
					e.start, e.end = start, end
					pending = append(pending, e)
				}
				if c.Entries++; c.Entries%yieldEvery == 0 {
					runtime.Gosched()
				}
				return nil
			})
		case "clients":
			start, end, err := s.value(nil)
			clients = data[start:end]
			return err
		default:
			return s.errorf("json: unknown field %q", field)
		}
	})
	if err != nil {
		return nil, nil, err
	}
	if s.peek() != 0 {
		return nil, nil, s.errorf("unexpected data after the JSON object")
	}
	return pending, clients, nil
}

// entry marks a key of the applied version seen, and says whether its
// fingerprint sum is unchanged. A key given twice is an error (a new key
// given twice is found when its entries are set).
func (r *Reader) entry(key []byte, sum uint64, c *Change) (pendingEntry, bool, error) {
	if p, ok := r.prints[string(key)]; ok {
		if p.gen == c.gen {
			return pendingEntry{}, false, fmt.Errorf("table[%q]: given twice", key)
		}
		p.gen = c.gen // seen: not gone
		r.prints[string(key)] = p
		if p.sum == sum {
			return pendingEntry{}, true, nil
		}
	}
	return pendingEntry{key: string(key), sum: sum}, false, nil
}

// decodeEach decodes and validates the changed entries one by one.
func (r *Reader) decodeEach(data []byte, pending []pendingEntry, c *Change) error {
	for i, e := range pending {
		var info HostInfo
		d := json.NewDecoder(bytes.NewReader(data[e.start:e.end]))
		d.DisallowUnknownFields()
		if err := d.Decode(&info); err != nil {
			return fmt.Errorf("line %d: table[%q]: %w", lineOf(data, int64(e.start)), e.key, err)
		}
		h, err := info.host(e.key, r.svc)
		if err != nil {
			return err
		}
		if err := r.set(e, h, c); err != nil {
			return err
		}
		if i%yieldEvery == yieldEvery-1 {
			runtime.Gosched()
		}
	}
	return nil
}

// decodeWhole decodes and validates the whole file at once (Parse and
// File.Hosts) and takes the changed entries from it.
func (r *Reader) decodeWhole(data []byte, pending []pendingEntry, c *Change) error {
	f, err := Parse(data)
	if err != nil {
		return err
	}
	hosts, _, err := f.Hosts(r.domain)
	if err != nil {
		return err
	}
	if len(pending) == len(hosts) {
		// Every entry changed (a first load, a rewrite), each key once (a
		// key given twice makes one pending entry more than hosts).
		for _, e := range pending {
			c.changed = append(c.changed, changedPrint{e.key, r.print(e, hosts[e.key], c)})
		}
		c.Set = hosts
		return nil
	}
	for _, e := range pending {
		if err := r.set(e, hosts[e.key], c); err != nil {
			return err
		}
	}
	return nil
}

// set adds a changed entry's host to c.
func (r *Reader) set(e pendingEntry, h Host, c *Change) error {
	if _, dup := c.Set[e.key]; dup {
		return fmt.Errorf("table[%q]: given twice", e.key)
	}
	c.Set[e.key] = h
	c.changed = append(c.changed, changedPrint{e.key, r.print(e, h, c)})
	return nil
}

// print is what the Reader will remember of a changed entry.
func (r *Reader) print(e pendingEntry, h Host, c *Change) entryPrint {
	p := entryPrint{sum: e.sum, gen: c.gen}
	if h.Name != e.key {
		p.name = h.Name
	}
	return p
}

// checkNames refuses two entries of one host name (names are
// case-insensitive and the trailing dot is optional). A key that is its
// own normalized name cannot meet another such key, so only the few keys
// that are not are looked at.
func (r *Reader) checkNames(c *Change) error {
	byName := map[string]string{}
	check := func(key, name string) error {
		if name == "" {
			return nil
		}
		other, ok := byName[name]
		if !ok {
			if _, ok = c.Set[name]; ok {
				other = name
			} else if q, seen := r.prints[name]; seen && q.gen == c.gen {
				ok, other = true, name
			}
		}
		if ok {
			return fmt.Errorf("table[%q]: same host as table[%q] (names are case-insensitive)", key, other)
		}
		byName[name] = key
		return nil
	}
	for _, e := range c.changed {
		if err := check(e.key, e.p.name); err != nil {
			return err
		}
	}
	for k, p := range r.prints {
		if _, changed := c.Set[k]; !changed && p.gen == c.gen {
			if err := check(k, p.name); err != nil {
				return err
			}
		}
	}
	return nil
}

// readClients decodes the clients (pod IP -> namespace): they are few.
func (r *Reader) readClients(raw []byte, c *Change) error {
	var m map[string]string
	if len(raw) > 0 {
		d := json.NewDecoder(bytes.NewReader(raw))
		if err := d.Decode(&m); err != nil {
			return fmt.Errorf("clients: %w", err)
		}
	}
	if len(m) > 0 {
		_, clients, err := (&File{Clients: m}).Hosts(r.domain)
		if err != nil {
			return err
		}
		c.Clients = clients
	}
	c.ClientsChanged = !r.applied || !maps.Equal(c.Clients, r.clients)
	return nil
}
