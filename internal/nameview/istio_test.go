package nameview

import (
	"encoding/json"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	nds "istio.io/istio/pkg/dns/proto"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// `table -o ndsz` output is Istio's NameTable: Istio's own Go type reads
// it strictly (no unknown field), and what Istio then writes, in either
// field-name style, loads as a name table that gives the same ndsz again.
func TestNDSRoundTripsThroughIstioType(t *testing.T) {
	tab := testTable(t)
	for _, ns := range []string{"apps", "infra", ""} {
		out, err := json.Marshal(NDS(tab, ns))
		if err != nil {
			t.Fatal(err)
		}
		var nt nds.NameTable
		if err := (protojson.UnmarshalOptions{}).Unmarshal(out, &nt); err != nil {
			t.Fatalf("Istio's NameTable refuses the ndsz of %q: %v\n%s", ns, err, out)
		}
		if len(nt.Table) == 0 {
			t.Fatalf("ndsz of %q is empty", ns)
		}
		for _, protoNames := range []bool{true, false} {
			istio, err := protojson.MarshalOptions{UseProtoNames: protoNames}.Marshal(&nt)
			if err != nil {
				t.Fatal(err)
			}
			f, err := nametable.Parse(istio)
			if err != nil {
				t.Fatalf("Parse(%s): %v", istio, err)
			}
			again, err := nametable.Build(f, nametable.Options{})
			if err != nil {
				t.Fatal(err)
			}
			b, _ := json.Marshal(NDS(again, ""))
			var nt2 nds.NameTable
			if err := protojson.Unmarshal(b, &nt2); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&nt, &nt2) {
				t.Errorf("ndsz of %q (proto names %v) after a round trip through Istio's type:\n got %s\nwant %s", ns, protoNames, b, out)
			}
		}
	}
}
