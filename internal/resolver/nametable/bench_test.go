package nametable

import (
	"fmt"
	"testing"
)

// file100k is 100k Kubernetes services over 100 namespaces, a tenth of them
// dual-stack with two ports, plus 1000 external hosts needing VIPs.
func file100k() *File {
	f := &File{Table: make(map[string]HostInfo, 101000)}
	for i := range 100000 {
		ns := i % 100
		info := HostInfo{
			Registry: RegistryKubernetes,
			IPs:      []string{fmt.Sprintf("10.%d.%d.%d", i>>16&0xff, i>>8&0xff, i&0xff)},
		}
		if i%10 == 0 {
			info.IPs = append(info.IPs, fmt.Sprintf("fd00::%x:%x", i>>16, i&0xffff))
			info.Ports = []Port{{Name: "http", Port: 80}, {Name: "grpc", Port: 9090}}
		}
		f.Table[fmt.Sprintf("svc%d.ns%d.svc.cluster.local", i, ns)] = info
	}
	for i := range 1000 {
		f.Table[fmt.Sprintf("ext%d.example.com", i)] = HostInfo{}
	}
	return f
}

func BenchmarkBuild100k(b *testing.B) {
	f := file100k()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		t, err := Build(f, Options{})
		if err != nil {
			b.Fatal(err)
		}
		if t.Len() != 101000 {
			b.Fatalf("Len = %d", t.Len())
		}
	}
}
