package nametable

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	nds "istio.io/istio/pkg/dns/proto"
)

// istioTable is a NameTable built with Istio's own Go type, as istiod and
// the Istio agent hold it.
func istioTable() *nds.NameTable {
	return &nds.NameTable{Table: map[string]*nds.NameTable_NameInfo{
		"reviews.bookinfo.svc.cluster.local": {
			Ips: []string{"10.96.12.7"}, Registry: "Kubernetes", Shortname: "reviews", Namespace: "bookinfo",
		},
		"api.payments.example.com": {
			Ips: []string{"240.240.0.9"}, Registry: "External", AltHosts: []string{"payments.internal"},
		},
	}}
}

// A table serialised the way Istio serialises it loads, in both of the
// field-name styles protojson writes and reads: the proto names
// (alt_hosts, what istiod's and the agent's debug endpoints give with
// UseProtoNames) and the lowerCamel JSON names (altHosts).
func TestParseIstioNameTableBothFieldStyles(t *testing.T) {
	for _, style := range []struct {
		name  string
		proto bool
	}{{"proto names", true}, {"json names", false}} {
		t.Run(style.name, func(t *testing.T) {
			data, err := protojson.MarshalOptions{UseProtoNames: style.proto}.Marshal(istioTable())
			if err != nil {
				t.Fatal(err)
			}
			if want := map[bool]string{true: `"alt_hosts"`, false: `"altHosts"`}[style.proto]; !strings.Contains(string(data), want) {
				t.Fatalf("protojson wrote %s, want the field %s", data, want)
			}
			f, err := Parse(data)
			if err != nil {
				t.Fatalf("Parse(%s): %v", data, err)
			}
			hosts, _, err := f.Hosts("")
			if err != nil {
				t.Fatal(err)
			}
			api := hosts["api.payments.example.com"]
			if !slices.Equal(api.AltNames(), []string{"payments.internal."}) {
				t.Errorf("alt names of api.payments.example.com = %v, want [payments.internal.]", api.AltNames())
			}
			if rv := hosts["reviews.bookinfo.svc.cluster.local"]; !rv.Kubernetes || len(rv.V4) != 1 {
				t.Errorf("reviews = %+v, want a Kubernetes host with one address", rv)
			}
		})
	}
}

// Both styles of one field at once is refused, as protojson refuses it,
// and an unknown field is refused with its name.
func TestParseIstioFieldErrors(t *testing.T) {
	for _, tt := range []struct{ name, data, want string }{
		{"both styles", `{"table": {"a.example.com": {"ips": ["192.0.2.1"], "altHosts": ["b.example.com"], "alt_hosts": ["c.example.com"]}}}`,
			`table["a.example.com"]: both altHosts and alt_hosts`},
		{"unknown json", `{"table": {"a.example.com": {"ips": ["192.0.2.1"], "alt_hostz": ["b"]}}}`, `unknown field "alt_hostz"`},
		{"unknown yaml", "table:\n  a.example.com:\n    short_name: a\n", `unknown field "short_name"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f, err := Parse([]byte(tt.data))
			if err == nil {
				_, _, err = f.Hosts("")
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}
