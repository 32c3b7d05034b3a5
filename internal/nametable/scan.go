package nametable

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"io"
	"slices"
	"unicode"
	"unicode/utf8"
)

// scanner walks a JSON document without decoding it: the name table
// file's two levels of objects, with each table entry's value skipped and
// fingerprinted. Only the white space outside strings is left out of a
// fingerprint, and white space between two bytes of literals (numbers,
// true, false, null) counts as one space, so two values with the same
// fingerprint have the same tokens: the same JSON, equally valid.
//
// The document is read from r through a window (data) of a few tens of
// kilobytes: a file is never held whole. Positions into data stay valid
// until compact, which drops what was scanned; it is called between table
// entries only.
type scanner struct {
	r     io.Reader
	chunk int    // read at a time, and scanned before compact drops it
	data  []byte // the window
	pos   int    // the next byte, in data
	lines int    // newlines of the input before data[0]
	eof   bool
	err   error // reading r failed
}

// scanChunk is the scanner's chunk.
const scanChunk = 32 << 10

// newScanner scans r in chunks of chunk bytes (0: scanChunk).
func newScanner(r io.Reader, chunk int) *scanner {
	if chunk <= 0 {
		chunk = scanChunk
	}
	return &scanner{r: r, chunk: chunk}
}

// more reads the next part of the input into the window, keeping what is
// there; false at the end of the input.
func (s *scanner) more() bool {
	for !s.eof {
		if len(s.data) == cap(s.data) {
			s.data = slices.Grow(s.data, s.chunk)
		}
		n, err := s.r.Read(s.data[len(s.data):cap(s.data)])
		s.data = s.data[:len(s.data)+n]
		if err != nil {
			s.eof = true
			if err != io.EOF {
				s.err = err
			}
		}
		if n > 0 {
			return true
		}
	}
	return false
}

// compact drops what was scanned from the window, once it is more than a
// chunk: every position into data moves.
func (s *scanner) compact() {
	if s.pos < s.chunk {
		return
	}
	s.lines += bytes.Count(s.data[:s.pos], []byte{'\n'})
	s.data = s.data[:copy(s.data, s.data[s.pos:])]
	s.pos = 0
}

// lineAt is the line of position i in data.
func (s *scanner) lineAt(i int) int {
	return s.lines + bytes.Count(s.data[:i], []byte{'\n'}) + 1
}

func (s *scanner) errorf(format string, args ...any) error {
	if s.err != nil {
		return fmt.Errorf("reading: %w", s.err)
	}
	return fmt.Errorf("line %d: %s", s.lineAt(s.pos), fmt.Sprintf(format, args...))
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func (s *scanner) space() {
	for {
		for s.pos < len(s.data) && isSpace(s.data[s.pos]) {
			s.pos++
		}
		if s.pos < len(s.data) || !s.more() {
			return
		}
	}
}

// first returns the input's first byte after Unicode white space, as
// bytes.TrimSpace skips it (false: there is none), and consumes nothing:
// Parse takes a file for JSON when that byte is '{'.
func (s *scanner) first() (byte, bool) {
	for i := s.pos; ; {
		for i >= len(s.data) || (s.data[i] >= utf8.RuneSelf && !utf8.FullRune(s.data[i:])) {
			if !s.more() {
				if i >= len(s.data) {
					return 0, false
				}
				return s.data[i], true // an incomplete rune at the end
			}
		}
		r, n := rune(s.data[i]), 1
		if r >= utf8.RuneSelf {
			r, n = utf8.DecodeRune(s.data[i:])
		}
		if !unicode.IsSpace(r) {
			return s.data[i], true
		}
		i += n
	}
}

// end is what peek returns at the end of the input.
const end = -1

// peek returns the next byte after white space (end at the end).
func (s *scanner) peek() int {
	s.space()
	if s.pos == len(s.data) {
		return end
	}
	return int(s.data[s.pos])
}

// expect consumes c after white space.
func (s *scanner) expect(c byte) error {
	if got := s.peek(); got != int(c) {
		if got == end {
			return s.errorf("unexpected end of JSON input, want %q", c)
		}
		return s.errorf("invalid character %q, want %q", byte(got), c)
	}
	s.pos++
	return nil
}

// literal consumes word (null) if it comes next.
func (s *scanner) literal(word string) bool {
	s.space()
	for len(s.data)-s.pos < len(word) && s.more() {
	}
	if len(s.data)-s.pos >= len(word) && string(s.data[s.pos:s.pos+len(word)]) == word {
		s.pos += len(word)
		return true
	}
	return false
}

// strStop marks the bytes a string's scan stops at: the quote, the
// backslash, control bytes and bytes beyond ASCII.
var strStop = func() (t [256]bool) {
	for c := range t {
		t[c] = c == '"' || c == '\\' || c < 0x20 || c >= utf8.RuneSelf
	}
	return t
}()

// str consumes a string and returns its raw bytes (between the quotes)
// and whether it holds escapes or bytes beyond ASCII.
func (s *scanner) str() ([]byte, bool, error) {
	if err := s.expect('"'); err != nil {
		return nil, false, err
	}
	d, start, esc := s.data, s.pos, false
	for i := start; ; {
		if i >= len(d) {
			if !s.more() {
				break
			}
			d = s.data
			continue
		}
		c := d[i]
		switch {
		case !strStop[c]:
			i++
		case c == '"':
			s.pos = i + 1
			return d[start:i], esc, nil
		case c == '\\':
			esc = true
			i += 2
		case c < 0x20:
			s.pos = i
			return nil, false, s.errorf("invalid character %q in string literal", c)
		default:
			esc = true
			i++
		}
	}
	s.pos = len(d)
	return nil, false, s.errorf("unexpected end of JSON input in a string")
}

// key consumes an object key and its colon. The key's bytes stay in data
// (no copy) unless it holds escapes or bytes beyond ASCII, which
// encoding/json decodes (invalid UTF-8 becomes U+FFFD) as Parse does.
func (s *scanner) key() ([]byte, error) {
	raw, esc, err := s.str()
	if err != nil {
		return nil, err
	}
	if esc {
		var k string
		if err := json.Unmarshal(s.data[s.pos-len(raw)-2:s.pos], &k); err != nil {
			return nil, s.errorf("object key: %v", err)
		}
		raw = []byte(k)
	}
	return raw, s.expect(':')
}

// value skips one JSON value, writing its bytes but white space outside
// strings to h (nil: none), and returns where it started and ended. Its
// syntax is checked only as far as skipping needs: a value that changed is
// decoded, and checked, by encoding/json.
func (s *scanner) value(h *maphash.Hash) (int, int, error) {
	s.space()
	start, depth := s.pos, 0
	word, spaced := false, false // the last byte was of a literal; white space followed it
	for s.pos < len(s.data) || s.more() {
		c := s.data[s.pos]
		if isSpace(c) {
			s.pos++
			spaced = word
			continue
		}
		if spaced && h != nil && !isStructural(c) {
			h.WriteByte(' ')
		}
		word, spaced = !isStructural(c), false
		switch {
		case c == '"':
			from := s.pos
			if _, _, err := s.str(); err != nil {
				return 0, 0, err
			}
			if h != nil {
				h.Write(s.data[from:s.pos])
			}
		case c == '{' || c == '[':
			depth++
			s.pos++
			if h != nil {
				h.WriteByte(c)
			}
		case c == '}' || c == ']':
			if depth == 0 {
				return start, s.pos, s.checkEnd(start)
			}
			depth--
			s.pos++
			if h != nil {
				h.WriteByte(c)
			}
		case c == ',' && depth == 0:
			return start, s.pos, s.checkEnd(start)
		default:
			s.pos++
			if h != nil {
				h.WriteByte(c)
			}
		}
		if depth == 0 && (c == '"' || c == '}' || c == ']') {
			return start, s.pos, nil
		}
	}
	if depth > 0 {
		return 0, 0, s.errorf("unexpected end of JSON input")
	}
	return start, s.pos, s.checkEnd(start)
}

// isStructural: the bytes that end a literal (and start a string).
func isStructural(c byte) bool {
	return c == '{' || c == '}' || c == '[' || c == ']' || c == ',' || c == ':' || c == '"'
}

// jsonFieldIs reports whether encoding/json takes the object key for the
// field name: the same bytes, or the same after its case folding.
func jsonFieldIs(key []byte, name string) bool {
	return string(key) == name || bytes.Equal(foldName(key), foldName([]byte(name)))
}

// foldName folds a name as encoding/json does to match field names: ASCII
// letters to upper case, any other rune to the smallest of its Unicode
// simple folding orbit.
func foldName(in []byte) []byte {
	out := make([]byte, 0, len(in))
	for i := 0; i < len(in); {
		if c := in[i]; c < utf8.RuneSelf {
			if 'a' <= c && c <= 'z' {
				c -= 'a' - 'A'
			}
			out = append(out, c)
			i++
			continue
		}
		r, n := utf8.DecodeRune(in[i:])
		for {
			r2 := unicode.SimpleFold(r)
			if r2 <= r {
				r = r2
				break
			}
			r = r2
		}
		out = utf8.AppendRune(out, r)
		i += n
	}
	return out
}

// checkEnd refuses an empty value.
func (s *scanner) checkEnd(start int) error {
	if s.pos == len(s.data) {
		return s.errorf("unexpected end of JSON input")
	}
	if s.pos == start {
		return s.errorf("invalid character %q looking for beginning of value", s.data[s.pos])
	}
	return nil
}

// object calls field for each key of an object (or of null), field
// consuming the value. With compact, the window is compacted before each
// key: field must keep no position into it.
func (s *scanner) object(compact bool, field func(key []byte) error) error {
	if s.literal("null") {
		return nil
	}
	if err := s.expect('{'); err != nil {
		return err
	}
	if s.peek() == '}' {
		s.pos++
		return nil
	}
	for {
		if compact {
			s.compact()
		}
		k, err := s.key()
		if err != nil {
			return err
		}
		if err := field(k); err != nil {
			return err
		}
		switch s.peek() {
		case ',':
			s.pos++
		case '}':
			s.pos++
			return nil
		case end:
			return s.errorf("unexpected end of JSON input")
		default:
			return s.errorf("invalid character %q after object key:value pair", s.data[s.pos])
		}
	}
}
