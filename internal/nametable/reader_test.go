package nametable

import (
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// A version of the file yields what changed against the version applied
// before it: new, changed and gone entries, and the clients when they
// changed; an unchanged version yields nothing. Both ways of decoding are
// taken: changed entries one by one (few changes among many entries) and
// the whole file (most of it changed).
func TestReaderReturnsOnlyChanges(t *testing.T) {
	for _, pad := range []int{0, 100} {
		t.Run(fmt.Sprintf("%d more entries", pad), func(t *testing.T) {
			json, yaml := filler(pad)
			r := NewReader("")
			steps := []struct {
				name, data string
				want       []string
				clients    bool
			}{
				{"first", `{"table": {` + json + `
			"a.example.com": {"ips": ["192.0.2.1"]},
			"b.example.com": {"ips": ["192.0.2.2"]},
			"c.example.com": {"ips": ["192.0.2.3"]}},
			"clients": {"10.0.0.1": "shop"}}`,
					append(fillerKeys(pad), "a.example.com", "b.example.com", "c.example.com"), true},
				{"one changed, one gone, one new", `{"table": {` + json + `
			"a.example.com": {"ips": ["192.0.2.1"]},
			"b.example.com": {"ips": ["192.0.2.20"]},
			"d.example.com": {"ips": ["192.0.2.4"]}},
			"clients": {"10.0.0.1": "shop"}}`,
					[]string{"-c.example.com", "b.example.com", "d.example.com"}, false},
				{"the same again, fields in another order", `{"clients": {"10.0.0.1": "shop"}, "table": {
			"d.example.com": {"ips": ["192.0.2.4"]},` + json + `
			"a.example.com": {"ips": ["192.0.2.1"]},
			"b.example.com": {"ips": ["192.0.2.20"]}}}`,
					nil, false},
				{"clients only", `{"table": {` + json + `
			"a.example.com": {"ips": ["192.0.2.1"]},
			"b.example.com": {"ips": ["192.0.2.20"]},
			"d.example.com": {"ips": ["192.0.2.4"]}},
			"clients": {"10.0.0.2": "shop"}}`,
					nil, true},
				{"as YAML", "table:\n" + yaml + "  a.example.com:\n    ips: [192.0.2.1]\n  b.example.com:\n    ips: [192.0.2.20]\nclients:\n  10.0.0.2: shop\n",
					[]string{"-d.example.com"}, false},
				{"empty", ``, append(gone(fillerKeys(pad)), "-a.example.com", "-b.example.com"), true},
			}
			for _, s := range steps {
				c, err := r.Read([]byte(s.data))
				if err != nil {
					t.Fatalf("%s: %v", s.name, err)
				}
				slices.Sort(s.want)
				if got := c.Keys(); !slices.Equal(got, s.want) {
					t.Errorf("%s: changed %v, want %v", s.name, got, s.want)
				}
				if c.ClientsChanged != s.clients {
					t.Errorf("%s: clients changed %v, want %v", s.name, c.ClientsChanged, s.clients)
				}
				if c.Empty() != (len(s.want) == 0 && !s.clients) {
					t.Errorf("%s: Empty() = %v", s.name, c.Empty())
				}
				r.Applied(c)
			}
		})
	}
}

// filler is n entries f<i>.example.com, as JSON object members (each
// followed by a comma) and as YAML.
func filler(n int) (string, string) {
	var j, y strings.Builder
	for i := range n {
		fmt.Fprintf(&j, "\n\"f%d.example.com\": {\"ips\": [\"198.51.100.%d\"]},", i, i)
		fmt.Fprintf(&y, "  f%d.example.com:\n    ips: [198.51.100.%d]\n", i, i)
	}
	return j.String(), y.String()
}

func fillerKeys(n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("f%d.example.com", i))
	}
	return out
}

func gone(keys []string) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = "-" + k
	}
	return out
}

// A version that fails, or that its consumer did not apply, leaves the
// Reader as it was: the next version is compared with the last applied.
func TestReaderKeepsTheAppliedVersion(t *testing.T) {
	r := NewReader("")
	v1 := `{"table": {"a.example.com": {"ips": ["192.0.2.1"]}, "b.example.com": {"ips": ["192.0.2.2"]}}}`
	c, err := r.Read([]byte(v1))
	if err != nil {
		t.Fatal(err)
	}
	r.Applied(c)
	bad := []string{
		`{"table": {"a.example.com": {"ips": ["192.0.2.9"]}, "b.example.com": {"ips": ["not an address"]}}}`,
		`{"table": {"a.example.com": {"ips": ["192.0.2.9"]}, "b.example.com": {"ips": ["192.0.2.2"]},`,
	}
	for _, b := range bad {
		if _, err := r.Read([]byte(b)); err == nil {
			t.Fatalf("Read(%s): no error", b)
		}
	}
	// Read, not applied (the store refused it).
	if _, err := r.Read([]byte(`{"table": {"a.example.com": {"ips": ["192.0.2.7"]}}}`)); err != nil {
		t.Fatal(err)
	}
	c, err = r.Read([]byte(`{"table": {"a.example.com": {"ips": ["192.0.2.1"]}, "b.example.com": {"ips": ["192.0.2.3"]}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Keys(); !slices.Equal(got, []string{"b.example.com"}) {
		t.Errorf("after failed and unapplied versions: changed %v, want only b.example.com", got)
	}
}

// The checks of Parse and File.Hosts hold, also across entries that did
// not change since the applied version.
func TestReaderErrors(t *testing.T) {
	for _, tt := range []struct {
		name, applied, data, want string
	}{
		{"json syntax", "", "{\n \"table\": {\n  \"a.b\": {\"ips\": [\"1.2.3.4\",]}\n}}", "line 3"},
		{"json type", "", "{\n\"table\": {\"a.b\": {\"ips\": \"1.2.3.4\"}}}", "line 2"},
		{"json type in one changed entry", `{"table": {"a.b": {}, "c.d": {}, "e.f": {}, "g.h": {}, "i.j": {}}}`, "{\"table\": {\"a.b\": {}, \"c.d\": {}, \"e.f\": {}, \"g.h\": {},\n\"i.j\": {\"ips\": \"1.2.3.4\"}}}", `line 2: table["i.j"]`},
		{"unknown field", "", `{"table": {"a.b": {"ipz": []}}}`, `unknown field "ipz"`},
		{"unknown top-level field", "", `{"tabel": {}}`, `unknown field "tabel"`},
		{"yaml syntax", "", "table:\n  a.b:\n    ips: [1.2.3.4\n  c: d\n", "line"},
		{"yaml unknown field", "", "table:\n  a.b:\n    ipz: [1.2.3.4]\n", `unknown field "ipz"`},
		{"both field styles", "", `{"table": {"a.example.com": {"altHosts": ["b.example.com"], "alt_hosts": ["c.example.com"]}}}`, "both altHosts and alt_hosts"},
		{"bad address", "", `{"table": {"a.b": {"ips": ["1.2.3"]}}}`, `table["a.b"].ips[0]`},
		{"one host twice", "", `{"table": {"A.example.com": {}, "a.example.com": {}}}`, "same host"},
		{"one host twice, one unchanged", `{"table": {"a.example.com": {}}}`,
			`{"table": {"a.example.com": {}, "A.EXAMPLE.com.": {}}}`, "same host"},
		{"one host twice, both aliases", "", `{"table": {"A.example.com": {}, "a.EXAMPLE.com": {}}}`, "same host"},
		{"a key twice", "", `{"table": {"a.example.com": {}, "a.example.com": {}}}`, "given twice"},
		{"a key twice, unchanged", `{"table": {"a.example.com": {}}}`, `{"table": {"a.example.com": {}, "a.example.com": {}}}`, "given twice"},
		{"data after the object", "", `{"table": {}} {}`, "unexpected data"},
		{"bad client", "", `{"clients": {"10.0.0.1": "a.b"}}`, "not a single DNS label"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := NewReader("")
			if tt.applied != "" {
				c, err := r.Read([]byte(tt.applied))
				if err != nil {
					t.Fatal(err)
				}
				r.Applied(c)
			}
			_, err := r.Read([]byte(tt.data))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Read error = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

// A first Read yields exactly the hosts and clients Parse and File.Hosts
// give: one format, one set of checks.
func TestReaderMatchesParse(t *testing.T) {
	data, err := os.ReadFile("../agent/default-names.yaml")
	if err != nil {
		t.Fatal(err)
	}
	f, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	hosts, clients, err := f.Hosts("")
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewReader("").Read(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Set) != len(hosts) || c.Entries != len(hosts) {
		t.Fatalf("%d hosts (%d entries), Parse gives %d", len(c.Set), c.Entries, len(hosts))
	}
	for _, e := range c.Set {
		if h, ok := hosts[e.Key]; !ok || !reflect.DeepEqual(*e.Host, h) {
			t.Errorf("%s: %+v, Parse gives %+v", e.Key, *e.Host, h)
		}
	}
	if !maps.Equal(c.Clients, clients) && !(len(c.Clients) == 0 && len(clients) == 0) {
		t.Errorf("clients %v, Parse gives %v", c.Clients, clients)
	}
}

// A version that changes every entry makes room for its changes about once,
// sized by the applied version, not by doubling past it: the slices it hands
// over are at most 5% larger than what changed (the allocator's rounding).
func TestReaderSizesARewriteOnce(t *testing.T) {
	const n = 10000
	r := appliedReader(t, meshFile(n, 1, every))
	v, err := r.Read(meshFile(n, 2, every))
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Set) != n {
		t.Fatalf("%d changed entries, want %d", len(v.Set), n)
	}
	if c := cap(v.Set); c > n+n/20 {
		t.Errorf("room for %d changes made for a rewrite of %d entries, want at most %d", c, n, n+n/20)
	}
}

// Reader.Rewrite is called once in a Read that rewrites most of the file,
// while it reads it, and not in a Read that changes a few entries.
func TestReaderToldOfARewriteWhileReading(t *testing.T) {
	const n = 10000
	r := appliedReader(t, meshFile(n, 1, every))
	calls := 0
	r.Rewrite = func() { calls++ }
	v, err := r.Read(meshFile(n, 2, onePercent))
	if err != nil {
		t.Fatal(err)
	}
	if calls != 0 {
		t.Fatalf("Rewrite called %d times for a version that changes 1%% of the entries", calls)
	}
	r.Applied(v)
	if _, err = r.Read(meshFile(n, 3, every)); err != nil {
		t.Fatal(err)
	}
	if calls != 1 {
		t.Fatalf("Rewrite called %d times for a version that changes every entry, want once", calls)
	}
}
