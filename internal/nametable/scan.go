package nametable

import (
	"encoding/json"
	"fmt"
	"hash/maphash"
)

// scanner walks a JSON document's bytes without decoding them: the name
// table file's two levels of objects, with each table entry's value
// skipped and fingerprinted. Only the bytes outside strings that are white
// space are left out of a fingerprint, so two values with the same
// fingerprint are the same JSON.
type scanner struct {
	data []byte
	pos  int
}

func (s *scanner) errorf(format string, args ...any) error {
	return fmt.Errorf("line %d: %s", lineOf(s.data, int64(s.pos)), fmt.Sprintf(format, args...))
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func (s *scanner) space() {
	for s.pos < len(s.data) && isSpace(s.data[s.pos]) {
		s.pos++
	}
}

// peek returns the next byte after white space (0 at the end).
func (s *scanner) peek() byte {
	s.space()
	if s.pos == len(s.data) {
		return 0
	}
	return s.data[s.pos]
}

// expect consumes c after white space.
func (s *scanner) expect(c byte) error {
	if got := s.peek(); got != c {
		if got == 0 {
			return s.errorf("unexpected end of JSON input, want %q", c)
		}
		return s.errorf("invalid character %q, want %q", got, c)
	}
	s.pos++
	return nil
}

// literal consumes word (null) if it comes next.
func (s *scanner) literal(word string) bool {
	s.space()
	if len(s.data)-s.pos >= len(word) && string(s.data[s.pos:s.pos+len(word)]) == word {
		s.pos += len(word)
		return true
	}
	return false
}

// str consumes a string and returns its raw bytes (between the quotes)
// and whether it holds escapes.
func (s *scanner) str() ([]byte, bool, error) {
	if err := s.expect('"'); err != nil {
		return nil, false, err
	}
	start, esc := s.pos, false
	for s.pos < len(s.data) {
		switch c := s.data[s.pos]; {
		case c == '"':
			s.pos++
			return s.data[start : s.pos-1], esc, nil
		case c == '\\':
			esc = true
			s.pos += 2
		case c < 0x20:
			return nil, false, s.errorf("invalid character %q in string literal", c)
		default:
			s.pos++
		}
	}
	return nil, false, s.errorf("unexpected end of JSON input in a string")
}

// key consumes an object key and its colon. The key's bytes stay in data
// (no copy) unless it holds escapes.
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
	for s.pos < len(s.data) {
		c := s.data[s.pos]
		switch {
		case isSpace(c):
			s.pos++
			continue
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

// checkEnd refuses an empty value.
func (s *scanner) checkEnd(start int) error {
	if s.pos == start {
		return s.errorf("invalid character %q looking for beginning of value", s.data[s.pos])
	}
	return nil
}

// object calls field for each key of an object (or of null), field
// consuming the value.
func (s *scanner) object(field func(key []byte) error) error {
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
		case 0:
			return s.errorf("unexpected end of JSON input")
		default:
			return s.errorf("invalid character %q after object key:value pair", s.data[s.pos])
		}
	}
}
