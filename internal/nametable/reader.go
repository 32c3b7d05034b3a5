package nametable

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"io"
	"maps"
	"net/netip"
	"runtime"
	"slices"
	"strings"
)

// Reader reads successive versions of one name table file and returns
// only what changed since the last version it was told was applied. It
// keeps a fingerprint of each entry's bytes, white space aside (about 40
// bytes per entry; the key's string is the one the table keeps):
// an entry whose bytes did not change is neither copied, decoded nor
// validated again. Changed entries are decoded one by one, straight into
// the hosts the table will keep; the file is never decoded as a whole.
// The format and its checks are Parse's and File.Hosts's
// (docs/name-table.md), with one addition: a table key or a top-level
// field given twice is an error.
//
// A Reader is not safe for concurrent use.
type Reader struct {
	// Rewrite, when set, is called once in a Read after a version was
	// applied, on the reading goroutine, as soon as the new version reads
	// as a rewrite of most of the file (see rewriting): its consumer may
	// prepare for a large change before the changed entries are decoded.
	Rewrite func()

	domain  string
	svc     string // ".svc.<domain>."
	seed    maphash.Seed
	keys    map[string]int32      // the applied version's keys -> their prints
	prints  []entryPrint          // without pointers: the collector skips it
	free    []int32               // unused prints
	clients map[netip.Addr]string // the applied version's clients
	gen     uint32                // of the Read in progress or last done
	applied bool                  // a version was applied
	dec     entryDecoder
	buf     []byte
	chunk   int // the scanner's (0: scanChunk; tests make it small)
}

// entryPrint is what a Reader remembers of an entry.
type entryPrint struct {
	sum uint64 // of the entry's bytes
	gen uint32 // the last Read that saw the key
	// changed: in that Read, the entry's bytes differed.
	changed bool
	// odd: the entry's host name is not its key with a trailing dot (upper
	// case, a trailing dot, white space): it may name the same host as
	// another key.
	odd bool
}

// Version is one version of the file as read: what it changes against
// the applied version.
type Version struct {
	Change
	// Entries is the number of table entries of the version.
	Entries int

	gen       uint32
	sums      []uint64 // of Set's entries
	rewriting bool     // Reader.Rewrite was called
}

// yieldEvery is how many entries the reading goroutine reads between two
// yields (runtime.Gosched), which leave the goroutines sharing its
// scheduler slot (upstream replies, TCP) their turn: about every 100 µs
// of reading.
const yieldEvery = 256

// NewReader returns a Reader for the cluster domain (for Kubernetes short
// names; "" is cluster.local).
func NewReader(domain string) *Reader {
	domain = strings.ToLower(strings.Trim(domain, "."))
	if domain == "" {
		domain = DefaultClusterDomain
	}
	return &Reader{domain: domain, svc: ".svc." + domain + ".", seed: maphash.MakeSeed(), keys: map[string]int32{}}
}

// Read parses and validates a version of the file (JSON, or YAML) and
// returns its changes against the applied version. Nothing is remembered
// until Applied: a version that fails here, or that its consumer refuses,
// leaves the Reader as it was.
func (r *Reader) Read(data []byte) (*Version, error) { return r.Decode(bytes.NewReader(data)) }

// Decode is Read of the file in. JSON (a file whose first character
// that is not white space is '{') is scanned as it is read, never held
// whole. YAML is read whole and decoded by Parse (and checked by
// File.Hosts), then encoded as JSON and read as such.
func (r *Reader) Decode(in io.Reader) (*Version, error) {
	s := newScanner(in, r.chunk)
	c, any := s.first()
	if s.err != nil {
		return nil, fmt.Errorf("reading: %w", s.err)
	}
	if any && c != '{' {
		j, err := r.yamlAsJSON(s)
		if err != nil {
			return nil, err
		}
		s = newScanner(bytes.NewReader(j), r.chunk)
	}
	r.gen++
	v := &Version{gen: r.gen}
	var clients []byte
	if any { // else empty, or white space only
		var err error
		if clients, err = r.scan(s, v); err != nil {
			return nil, err
		}
	}
	if err := r.checkNames(v); err != nil {
		return nil, err
	}
	if err := r.readClients(clients, v); err != nil {
		return nil, err
	}
	for k, i := range r.keys {
		if r.prints[i].gen != v.gen {
			v.Gone = append(v.Gone, k)
		}
	}
	return v, nil
}

// yamlAsJSON reads the rest of a YAML file and returns it as JSON, after
// the checks of Parse and File.Hosts: Parse's YAML semantics (strict,
// converting scalars to the fields' types) are kept exactly.
func (r *Reader) yamlAsJSON(s *scanner) ([]byte, error) {
	for s.more() {
	}
	if s.err != nil {
		return nil, fmt.Errorf("reading: %w", s.err)
	}
	f, err := Parse(s.data)
	if err != nil {
		return nil, err
	}
	if _, _, err := f.Hosts(r.domain); err != nil {
		return nil, err
	}
	return json.Marshal(f)
}

// Applied records v, which its consumer applied, as the current version.
func (r *Reader) Applied(v *Version) {
	if len(r.keys) == 0 { // sized once: a first load does not grow them step by step
		r.keys = make(map[string]int32, len(v.Set))
		r.prints = slices.Grow(r.prints[:0], len(v.Set))
		r.free = r.free[:0]
	}
	for _, k := range v.Gone {
		r.free = append(r.free, r.keys[k])
		delete(r.keys, k)
	}
	for n, e := range v.Set {
		i, ok := r.keys[e.Key]
		switch {
		case ok:
		case len(r.free) > 0:
			i, r.free = r.free[len(r.free)-1], r.free[:len(r.free)-1]
		default:
			i = int32(len(r.prints))
			r.prints = append(r.prints, entryPrint{})
		}
		r.prints[i] = entryPrint{sum: v.sums[n], gen: v.gen, odd: !plainName(e.Key, e.Host.Name)}
		r.keys[e.Key] = i // also for a known key: the map keeps this key's string, the table's
	}
	if v.ClientsChanged {
		r.clients = v.Clients
	}
	r.applied = true
}

// plainName reports whether name is key with a trailing dot.
func plainName(key, name string) bool {
	return len(name) == len(key)+1 && name[len(key)] == '.' && name[:len(key)] == key
}

// scan walks the file: entries that did not change are marked seen, the
// others decoded into v. It returns the clients' bytes.
func (r *Reader) scan(s *scanner, v *Version) (clients []byte, err error) {
	var h maphash.Hash
	h.SetSeed(r.seed)
	var fields int
	err = s.object(false, func(field []byte) error {
		var bit int
		switch {
		case jsonFieldIs(field, "table"):
			bit = 1
		case jsonFieldIs(field, "clients"):
			bit = 2
		default:
			return s.errorf("json: unknown field %q", field)
		}
		if fields&bit != 0 {
			return s.errorf("json: field %q given twice", field)
		}
		fields |= bit
		if bit == 2 {
			start, end, err := s.value(nil)
			clients = bytes.Clone(s.data[start:end])
			return err
		}
		return s.object(true, func(key []byte) error {
			h.Reset()
			start, end, err := s.value(&h)
			if err != nil {
				return err
			}
			if v.Entries++; v.Entries%yieldEvery == 0 {
				runtime.Gosched()
			}
			return r.entry(s, key, start, end, h.Sum64(), v)
		})
	})
	if err != nil {
		return nil, err
	}
	if s.peek() != end {
		return nil, s.errorf("unexpected data after the JSON object")
	}
	return clients, r.checkNewKeys(v)
}

// entry takes one table entry: a key of the applied version whose bytes
// did not change is marked seen; any other is decoded and validated into
// a host of v. A key of the applied version given twice is found here,
// a new one by checkNewKeys.
func (r *Reader) entry(s *scanner, rawKey []byte, start, end int, sum uint64, v *Version) error {
	i, known := r.keys[string(rawKey)]
	if known {
		p := &r.prints[i]
		if p.gen == v.gen {
			return fmt.Errorf("table[%q]: given twice", rawKey)
		}
		p.gen, p.changed = v.gen, p.sum != sum
		if !p.changed {
			return nil
		}
	}
	key, name := r.keyName(rawKey)
	h, err := r.decode(s, start, end, key, name)
	if err != nil {
		return err
	}
	if len(v.Set) == cap(v.Set) {
		more := r.growBy(v)
		v.Set = slices.Grow(v.Set, more)
		v.sums = slices.Grow(v.sums, more)
	}
	v.Set = append(v.Set, KeyHost{key, h})
	v.sums = append(v.sums, sum)
	if !v.rewriting && r.Rewrite != nil && r.applied && rewriting(v) {
		v.rewriting = true
		r.Rewrite()
	}
	return nil
}

// rewriting reports whether v, as read so far, rewrites most of the file:
// at least half of the first 1,024 or more entries read changed.
func rewriting(v *Version) bool { return v.Entries >= 1024 && 2*len(v.Set) >= v.Entries }

// growBy is how many more changed entries v makes room for when it is full:
// as many as it has (doubling: append grows large slices by a quarter), or,
// once at least half of the entries read so far changed, the rest of the
// applied version's entries, so that a rewrite of every entry grows v once
// to about its final size rather than doubling past it.
func (r *Reader) growBy(v *Version) int {
	if rewriting(v) {
		return max(len(r.keys)-v.Entries, 0) + 16
	}
	return len(v.Set) + 16
}

// checkNewKeys refuses a key given twice among the changed entries (only
// new keys can be: see entry). Their hashes are sorted, not put in a map:
// a first load has every key to compare.
func (r *Reader) checkNewKeys(v *Version) error {
	type keyHash struct {
		h uint64
		i int
	}
	hs := make([]keyHash, len(v.Set))
	for i, e := range v.Set {
		hs[i] = keyHash{maphash.String(r.seed, e.Key), i}
	}
	slices.SortFunc(hs, func(a, b keyHash) int { return cmp.Compare(a.h, b.h) })
	for i := 1; i < len(hs); i++ {
		for j := i - 1; j >= 0 && hs[j].h == hs[i].h; j-- {
			if a, b := v.Set[hs[j].i].Key, v.Set[hs[i].i].Key; a == b {
				return fmt.Errorf("table[%q]: given twice", a)
			}
		}
	}
	return nil
}

// keyName makes the strings of a changed entry's key and, when the key is
// a plain name (lower case, no trailing dot), of its host name: one
// allocation holds both, the key being the name without its dot.
func (r *Reader) keyName(raw []byte) (key, name string) {
	for _, c := range raw {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.' || c == '*') {
			return string(raw), ""
		}
	}
	if len(raw) == 0 || raw[len(raw)-1] == '.' {
		return string(raw), ""
	}
	r.buf = append(append(r.buf[:0], raw...), '.')
	name = string(r.buf)
	return name[:len(name)-1], name
}

// decode decodes and validates the entry key's value, the scanner's
// data[start:end], into its host; name, when not "", is key's host name,
// to check.
func (r *Reader) decode(s *scanner, start, end int, key, name string) (*Host, error) {
	value := s.data[start:end]
	info, ok := r.dec.decode(value)
	if !ok {
		info = new(HostInfo)
		d := json.NewDecoder(bytes.NewReader(value))
		d.DisallowUnknownFields()
		if err := d.Decode(info); err != nil {
			return nil, fmt.Errorf("line %d: table[%q]: %w", s.lineAt(start), key, err)
		}
	}
	var h Host
	var err error
	if n, nerr := NormName(name); name != "" && nerr == nil && n == name {
		h, err = info.hostOf(key, name, r.svc)
	} else {
		h, err = info.host(key, r.svc)
	}
	if err != nil {
		return nil, err
	}
	return &h, nil
}

// checkNames refuses two entries of one host name (names are
// case-insensitive and the trailing dot is optional). Two keys that are
// their names without the dot cannot name one host: only the odd keys
// (see entryPrint) are looked at, each against the others and against the
// key that is its name without the dot.
func (r *Reader) checkNames(v *Version) error {
	odd := map[string][]string{} // name -> its odd keys
	for _, e := range v.Set {
		if !plainName(e.Key, e.Host.Name) {
			odd[e.Host.Name] = append(odd[e.Host.Name], e.Key)
		}
	}
	for k, i := range r.keys {
		if p := r.prints[i]; p.gen == v.gen && p.odd && !p.changed {
			if name, err := NormName(k); err == nil {
				odd[name] = append(odd[name], k)
			}
		}
	}
	if len(odd) == 0 {
		return nil
	}
	var newKeys map[string]bool
	var conflicts [][2]string // the key File.Hosts names, and the one before it
	for name, keys := range odd {
		plain := strings.TrimSuffix(name, ".")
		if i, ok := r.keys[plain]; ok && r.prints[i].gen == v.gen {
			keys = append(keys, plain)
		} else if !ok {
			if newKeys == nil {
				newKeys = map[string]bool{}
				for _, e := range v.Set {
					newKeys[e.Key] = true
				}
			}
			if newKeys[plain] {
				keys = append(keys, plain)
			}
		}
		if len(keys) > 1 {
			slices.Sort(keys)
			conflicts = append(conflicts, [2]string{keys[1], keys[0]})
		}
	}
	if len(conflicts) == 0 {
		return nil
	}
	c := slices.MinFunc(conflicts, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return fmt.Errorf("table[%q]: same host as table[%q] (names are case-insensitive)", c[0], c[1])
}

// readClients decodes the clients (pod IP -> namespace): they are few.
func (r *Reader) readClients(raw []byte, v *Version) error {
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
		v.Clients = clients
	}
	v.ClientsChanged = !r.applied || !maps.Equal(v.Clients, r.clients)
	return nil
}
