package nametable

import (
	"fmt"
	"net/netip"
	"runtime"
	"testing"
	"unsafe"
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

// BenchmarkUpdateOne100k changes one Service of a 100k-host table and
// publishes: the cost of one API event (no full rebuild).
func BenchmarkUpdateOne100k(b *testing.B) {
	f := file100k()
	bl, err := NewBuilder(Options{})
	if err != nil {
		b.Fatal(err)
	}
	hosts, clients, err := f.Hosts("")
	if err != nil {
		b.Fatal(err)
	}
	bl.AddSource("file", 0)
	if err := bl.Load("file", hosts, clients); err != nil {
		b.Fatal(err)
	}
	if _, err := bl.Publish(); err != nil {
		b.Fatal(err)
	}
	key := "svc4242.ns42.svc.cluster.local"
	h := hosts[key]
	b.ReportAllocs()
	b.ResetTimer()
	i := 0
	for b.Loop() {
		i++
		h.V4 = []netip.Addr{netip.AddrFrom4([4]byte{10, 200, byte(i >> 8), byte(i)})}
		if err := bl.Set("file", key, []Host{h}); err != nil {
			b.Fatal(err)
		}
		if _, err := bl.Publish(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFind is the lookup of the query path: exact, short and bare
// forms. It must not allocate.
func BenchmarkFind(b *testing.B) {
	t, err := Build(file100k(), Options{})
	if err != nil {
		b.Fatal(err)
	}
	names := []string{"svc4242.ns42.svc.cluster.local.", "svc4242.ns42.", "svc4242.", "nope.example.com."}
	client := netip.Addr{}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		if n, _ := t.Find(names[i%4], client); n == nil && i%4 != 3 {
			b.Fatalf("%s not found", names[i%4])
		}
	}
}

// A table keeps one Host per host: the struct stays within the 160-byte
// size class (what few hosts have is behind Host.Extra, the source is a
// pointer, and a name's entry does not repeat the name it is stored under).
func TestHostSize(t *testing.T) {
	if size := unsafe.Sizeof(Host{}); size > 160 {
		t.Errorf("Host is %d bytes, want <= 160 (one size class)", size)
	}
}

// TestMemory100k bounds the live heap a 100k-Service table takes per host
// (bench/RESULTS.md has the measured values).
func TestMemory100k(t *testing.T) {
	const maxPerHost = 480
	if testing.Short() {
		t.Skip("-short")
	}
	f := file100k()
	hosts, clients, err := f.Hosts("")
	if err != nil {
		t.Fatal(err)
	}
	f = nil
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	bl, err := NewBuilder(Options{})
	if err != nil {
		t.Fatal(err)
	}
	bl.AddSource("file", 0)
	for k, h := range hosts {
		if err := bl.Set("file", k, []Host{h}); err != nil {
			t.Fatal(err)
		}
	}
	_ = clients
	tb, err := bl.Publish()
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(hosts) // the input is not part of the table's cost
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(tb.Len())
	t.Logf("%d hosts: %.1f MB live heap, %.0f bytes per host", tb.Len(), float64(after.HeapAlloc-before.HeapAlloc)/1e6, per)
	if per > maxPerHost {
		t.Errorf("%.0f bytes of live heap per host, want <= %d", per, maxPerHost)
	}
	runtime.KeepAlive(bl)
}
