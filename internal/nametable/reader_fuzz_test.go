package nametable

import (
	"bytes"
	"encoding/json"
	"maps"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"testing/iotest"
)

// entrySeeds are table entry values: the common form, and forms the fast
// decoder leaves to encoding/json.
var entrySeeds = []string{
	`{"ips":["240.0.0.1"],"registry":"Kubernetes","shortname":"svc-0","namespace":"ns-0"}`,
	`{ "ips" : [ "10.0.0.1" , "fd00::1" ] , "registry" : "external" }`,
	`{"altHosts":["b.example.com","C.example.com."],"ports":[{"name":"http","port":80},{"name":"DNS","port":53,"protocol":"UDP"}]}`,
	`{"alt_hosts":[],"altHosts":null}`,
	`{"altHosts":[],"alt_hosts":["x.example.com"]}`,
	`{}`,
	`null`,
	`{"ips":null}`,
	`{"IPs":["1.2.3.4"]}`,
	`{"ips":["1.2.3.4"],"ips":["5.6.7.8"]}`,
	`{"ports":[{"name":"a","port":1,"protocol":"UDP"}],"ports":[{"name":"b","port":2}]}`,
	`{"ports":[{"port":1e2}]}`,
	`{"ports":[{"port":80.0}]}`,
	`{"ports":[{"port":-0}]}`,
	`{"ports":[{"port":0123}]}`,
	`{"ports":[{"port":123456789012345678901}]}`,
	`{"ports":[{"port":"80"}]}`,
	`{"registry":"Kub\u0065rnetes"}`,
	`{"namespace":"ns\t"}`,
	`{"shortname":"é"}`,
	`{"ipz":[]}`,
	`{"ips":["1.2.3.4",]}`,
	`{"ips":["1.2.3.4"]} x`,
	`{"ips":["1.2.3.4"]`,
	`{"ports":[{"name":"a","port":1,"extra":true}]}`,
	`[]`,
	`"a"`,
}

// Wherever the fast entry decoder takes a value, encoding/json (as Parse
// decodes a table entry, unknown fields refused) takes it too and gives
// the same HostInfo; a decoder that decoded another entry before (its
// arrays reused) gives the same.
func FuzzEntryDecoderMatchesJSON(f *testing.F) {
	for _, s := range entrySeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var d entryDecoder
		d.decode([]byte(`{"ips":["9.9.9.9","8.8.8.8"],"altHosts":["z.example"],"alt_hosts":["y.example"],"ports":[{"name":"z","port":9,"protocol":"SCTP"}]}`))
		got, ok := d.decode(data)
		if !ok {
			return
		}
		if !json.Valid(data) {
			t.Fatalf("the decoder took %q, which is not JSON", data)
		}
		var want HostInfo
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&want); err != nil {
			t.Fatalf("the decoder took %q, encoding/json refuses it: %v", data, err)
		}
		if !reflect.DeepEqual(*got, want) {
			t.Fatalf("%q: the decoder gives %#v, encoding/json %#v", data, *got, want)
		}
	})
}

// The decoder takes the common form of an entry without allocating but for
// the strings it returns.
func TestEntryDecoderAllocations(t *testing.T) {
	var d entryDecoder
	data := []byte(entrySeeds[0])
	d.decode(data) // the arrays, and the repeated strings
	if n := testing.AllocsPerRun(100, func() {
		if _, ok := d.decode(data); !ok {
			t.Fatal("not taken")
		}
	}); n > 1 {
		t.Errorf("%.0f allocations per entry, want 1 (its address)", n)
	}
}

// tableSeeds are name table files: valid ones and ones Parse refuses.
var tableSeeds = []string{
	`{"table": {"a.example.com": {"ips": ["192.0.2.1"]}, "b.example.com": {"ips": ["192.0.2.2"], "altHosts": ["c.example.com"]}}, "clients": {"10.0.0.1": "shop"}}`,
	`{"table": {"svc-0.ns-0.svc.cluster.local": {"ips": ["240.0.0.1"], "registry": "Kubernetes", "shortname": "svc-0", "namespace": "ns-0"}}}`,
	`{"table": {"A.example.com": {}, "a.example.com.": {"ips": ["192.0.2.1"]}}}`,
	`{"table": {"*.example.com": {"ips": ["192.0.2.1"]}, "x.example.com": {"ips": ["192.0.2.9"]}}}`,
	`{"TABLE": {"a\u002eexample.com": {"ips": ["192.0.2.1"]}}}`,
	`{"table": {"a.example.com": {}}, "table": {"b.example.com": {}}}`,
	`{"table": {"a.example.com": {}, "a.example.com": {}}}`,
	`{"table": {"a.example.com": {"ips": ["192.0.2.1"]}}} ]`,
	`{"table": null, "clients": null}`,
	`{"table": {"a.example.com": {"ports": [{"name": "http", "port": 80}]}}, "clients": {"10.0.0.1": "a.b"}}`,
	"table:\n  a.example.com:\n    ips: [192.0.2.1]\n    namespace: 123\n",
	"table:\n  a.example.com:\n    altHosts: []\n    alt_hosts: [b.example.com]\n",
	"\u00a0",
	"\f{}",
	"null",
	"",
	`{"table": {"a.example.com": {"ports": [{"port": 8 0}]}}}`,
	`{"table": {"a.example.com": {"ips": ["192.0.2.1"], "ipz": 1}}}`,
}

// Reading a version, after another one was applied, gives exactly the
// table Parse and File.Hosts give for it: the Reader takes what they take,
// with the same hosts and clients, and refuses what they refuse. The one
// difference: a table key or a top-level field given twice, which Parse
// takes (the last one wins), is an error. The scanner's window is made
// small and its input comes a byte at a time, so that every place it
// refills or moves is crossed.
func FuzzReaderMatchesParse(f *testing.F) {
	for i, s := range tableSeeds {
		f.Add([]byte(tableSeeds[(i+1)%len(tableSeeds)]), []byte(s), uint8(i))
	}
	f.Fuzz(func(t *testing.T, prev, data []byte, chunk uint8) {
		r := NewReader("")
		r.chunk = int(chunk%32) + 1
		state := map[string]Host{}
		var clients map[netip.Addr]string
		if v, err := r.Decode(iotest.OneByteReader(bytes.NewReader(prev))); err == nil {
			applyVersion(state, &clients, v)
			r.Applied(v)
		}
		v, err := r.Decode(iotest.HalfReader(bytes.NewReader(data)))
		want, wantClients, perr := parseHosts(data)
		switch {
		case err == nil && perr != nil:
			t.Fatalf("%q: the Reader takes it, Parse refuses it: %v", data, perr)
		case err != nil && perr == nil:
			if !strings.Contains(err.Error(), "given twice") || !hasDuplicateKey(data) {
				t.Fatalf("%q: the Reader refuses it (%v), Parse takes it", data, err)
			}
		case err == nil:
			applyVersion(state, &clients, v)
			if !reflect.DeepEqual(state, want) {
				t.Fatalf("%q after %q: the Reader gives %v, Parse %v", data, prev, state, want)
			}
			if !maps.Equal(clients, wantClients) {
				t.Fatalf("%q after %q: clients %v, Parse gives %v", data, prev, clients, wantClients)
			}
		}
	})
}

func parseHosts(data []byte) (map[string]Host, map[netip.Addr]string, error) {
	f, err := Parse(data)
	if err != nil {
		return nil, nil, err
	}
	hosts, clients, err := f.Hosts("")
	if hosts == nil {
		hosts = map[string]Host{}
	}
	return hosts, clients, err
}

// applyVersion applies what v changes to a map of hosts and the clients.
func applyVersion(state map[string]Host, clients *map[netip.Addr]string, v *Version) {
	for _, k := range v.Gone {
		delete(state, k)
	}
	for _, e := range v.Set {
		state[e.Key] = *e.Host
	}
	if v.ClientsChanged {
		*clients = v.Clients
	}
}

// hasDuplicateKey reports whether a JSON name table gives a top-level
// field twice (as encoding/json matches them: by case folding) or a key of
// its table twice.
func hasDuplicateKey(data []byte) bool {
	d := json.NewDecoder(bytes.NewReader(data))
	if tok, err := d.Token(); err != nil || tok != json.Delim('{') {
		return false
	}
	top := map[string]bool{}
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return false
		}
		f := string(foldName([]byte(tok.(string))))
		if top[f] {
			return true
		}
		top[f] = true
		if f != "TABLE" {
			var skip json.RawMessage
			if d.Decode(&skip) != nil {
				return false
			}
			continue
		}
		if tok, err := d.Token(); err != nil || tok != json.Delim('{') {
			continue // null (or an error Parse reports)
		}
		keys := map[string]bool{}
		for d.More() {
			tok, err := d.Token()
			if err != nil {
				return false
			}
			if keys[tok.(string)] {
				return true
			}
			keys[tok.(string)] = true
			var skip json.RawMessage
			if d.Decode(&skip) != nil {
				return false
			}
		}
		if _, err := d.Token(); err != nil {
			return false
		}
	}
	return false
}
