package nametable

// entryDecoder decodes the common form of a table entry's JSON value
// without reflection: an object of HostInfo's fields, spelled exactly as
// HostInfo's tags, each given once, whose strings are printable ASCII
// without escapes and whose port numbers are plain integers. For anything
// else (null, an unknown or differently spelled field, a field given
// twice, escapes, other types, a syntax error) decode reports false and
// the caller decodes the value with encoding/json, which gives the result,
// or the error, Parse gives. FuzzEntryDecoderMatchesJSON holds the two
// equal wherever decode succeeds.
//
// The decoder keeps its slices' arrays from one entry to the next: the
// HostInfo it returns is valid until the next decode, and HostInfo.host
// keeps none of its slices.
type entryDecoder struct {
	data []byte
	pos  int
	info HostInfo
	// Arrays reused across entries.
	ips, alts, altsProto []string
	ports                []Port
	// Strings that repeat across entries (namespaces, short names, port
	// names), so that they are not copied for every entry.
	interned map[string]string
}

// maxInterned bounds the strings an entryDecoder keeps.
const maxInterned = 4096

// HostInfo's fields, as bits of a set.
const (
	fieldIPs = 1 << iota
	fieldRegistry
	fieldShortname
	fieldNamespace
	fieldAltHosts
	fieldAltHostsProto
	fieldPorts
)

// decode decodes data, one JSON value, into the decoder's HostInfo.
func (d *entryDecoder) decode(data []byte) (*HostInfo, bool) {
	d.data, d.pos = data, 0
	d.info = HostInfo{}
	if !d.object(d.hostField) {
		return nil, false
	}
	d.space()
	return &d.info, d.pos == len(d.data)
}

func (d *entryDecoder) space() {
	for d.pos < len(d.data) && isSpace(d.data[d.pos]) {
		d.pos++
	}
}

// next consumes c after white space.
func (d *entryDecoder) next(c byte) bool {
	d.space()
	if d.pos < len(d.data) && d.data[d.pos] == c {
		d.pos++
		return true
	}
	return false
}

// object decodes an object, calling field for each key (the value follows
// the colon). Every key must be new to the object: field gets the set of
// the bits of the keys seen so far, and returns it with its key's.
func (d *entryDecoder) object(field func(key []byte, seen int) (int, bool)) bool {
	if !d.next('{') {
		return false
	}
	if d.next('}') {
		return true
	}
	seen := 0
	for {
		d.space()
		key, ok := d.plain()
		if !ok || !d.next(':') {
			return false
		}
		if seen, ok = field(key, seen); !ok {
			return false
		}
		if d.next(',') {
			continue
		}
		return d.next('}')
	}
}

func (d *entryDecoder) hostField(key []byte, seen int) (int, bool) {
	i := &d.info
	var bit int
	var ok bool
	switch string(key) {
	case "ips":
		bit, ok = fieldIPs, d.strings(&d.ips, &i.IPs, false)
	case "registry":
		bit, ok = fieldRegistry, d.str(&i.Registry, true)
	case "shortname":
		bit, ok = fieldShortname, d.str(&i.Shortname, true)
	case "namespace":
		bit, ok = fieldNamespace, d.str(&i.Namespace, true)
	case "altHosts":
		bit, ok = fieldAltHosts, d.strings(&d.alts, &i.AltHosts, false)
	case "alt_hosts":
		bit, ok = fieldAltHostsProto, d.strings(&d.altsProto, &i.AltHostsProto, false)
	case "ports":
		bit, ok = fieldPorts, d.portList()
	}
	return seen | bit, ok && seen&bit == 0
}

// plain consumes a string of printable ASCII without escapes and returns
// its bytes.
func (d *entryDecoder) plain() ([]byte, bool) {
	if d.pos >= len(d.data) || d.data[d.pos] != '"' {
		return nil, false
	}
	start := d.pos + 1
	for i := start; i < len(d.data); i++ {
		switch c := d.data[i]; {
		case c == '"':
			d.pos = i + 1
			return d.data[start:i], true
		case c < 0x20 || c == '\\' || c > 0x7e:
			return nil, false
		}
	}
	return nil, false
}

// str decodes a string value; intern: one that repeats across entries.
func (d *entryDecoder) str(out *string, intern bool) bool {
	d.space()
	b, ok := d.plain()
	if !ok {
		return false
	}
	if !intern {
		*out = string(b)
		return true
	}
	if s, ok := d.interned[string(b)]; ok {
		*out = s
		return true
	}
	*out = string(b)
	if d.interned == nil {
		d.interned = map[string]string{}
	}
	if len(d.interned) < maxInterned {
		d.interned[*out] = *out
	}
	return true
}

// strings decodes an array of strings into buf's array and sets out to
// it: never nil, as encoding/json makes an empty array.
func (d *entryDecoder) strings(buf *[]string, out *[]string, intern bool) bool {
	if !d.next('[') {
		return false
	}
	list := (*buf)[:0]
	if list == nil {
		list = make([]string, 0, 2)
	}
	if !d.next(']') {
		for {
			var s string
			if !d.str(&s, intern) {
				return false
			}
			list = append(list, s)
			if d.next(',') {
				continue
			}
			if !d.next(']') {
				return false
			}
			break
		}
	}
	*buf, *out = list, list
	return true
}

func (d *entryDecoder) portList() bool {
	if !d.next('[') {
		return false
	}
	list := d.ports[:0]
	if list == nil {
		list = make([]Port, 0, 2)
	}
	if !d.next(']') {
		for {
			var p Port
			if !d.object(func(key []byte, seen int) (int, bool) { return d.portField(&p, key, seen) }) {
				return false
			}
			list = append(list, p)
			if d.next(',') {
				continue
			}
			if !d.next(']') {
				return false
			}
			break
		}
	}
	d.ports, d.info.Ports = list, list
	return true
}

func (d *entryDecoder) portField(p *Port, key []byte, seen int) (int, bool) {
	var bit int
	var ok bool
	switch string(key) {
	case "name":
		bit, ok = 1, d.str(&p.Name, true)
	case "port":
		bit, ok = 2, d.integer(&p.Port)
	case "protocol":
		bit, ok = 4, d.str(&p.Protocol, true)
	}
	return seen | bit, ok && seen&bit == 0
}

// integer decodes a JSON number that is an integer of at most 18 digits
// (no fraction, no exponent: those are encoding/json's to refuse).
func (d *entryDecoder) integer(out *int) bool {
	d.space()
	i, neg := d.pos, false
	if i < len(d.data) && d.data[i] == '-' {
		neg = true
		i++
	}
	start, n := i, 0
	for ; i < len(d.data) && d.data[i] >= '0' && d.data[i] <= '9'; i++ {
		n = n*10 + int(d.data[i]-'0')
	}
	digits := i - start
	if digits == 0 || digits > 18 || (digits > 1 && d.data[start] == '0') {
		return false
	}
	if i < len(d.data) {
		if c := d.data[i]; c == '.' || c == 'e' || c == 'E' {
			return false
		}
	}
	if neg {
		n = -n
	}
	*out, d.pos = n, i
	return true
}
