package ndssource

import (
	"fmt"
	"log/slog"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	nds "istio.io/istio/pkg/dns/proto"
)

// BenchmarkPush10k is the agent's share of one push at 10k Services: decode
// the NameTable from its Any, and diff it against the view's last table
// (one name changed), as a session and Run do.
func BenchmarkPush10k(b *testing.B) {
	const n = 10000
	mk := func(gen int) *anypb.Any {
		nt := &nds.NameTable{Table: make(map[string]*nds.NameTable_NameInfo, n)}
		for i := range n {
			ip := fmt.Sprintf("10.96.%d.%d", i>>8, i&0xff)
			if i == 7 {
				ip = fmt.Sprintf("10.128.0.%d", gen%250)
			}
			nt.Table[fmt.Sprintf("svc-%d.bench-%d.svc.cluster.local", i, i%100)] = &nds.NameTable_NameInfo{
				Ips: []string{ip}, Registry: "Kubernetes", Shortname: fmt.Sprintf("svc-%d", i), Namespace: fmt.Sprintf("bench-%d", i%100)}
		}
		a, err := anypb.New(nt)
		if err != nil {
			b.Fatal(err)
		}
		return a
	}
	pushes := []*anypb.Any{mk(0), mk(1)}
	r := newRec()
	m := newMerger(r, "cluster.local", slog.Default())
	m.want("bench-0")
	m.apply("bench-0", &nds.NameTable{})
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		nt := &nds.NameTable{}
		if err := proto.Unmarshal(pushes[i%2].GetValue(), nt); err != nil {
			b.Fatal(err)
		}
		m.apply("bench-0", nt)
	}
}
