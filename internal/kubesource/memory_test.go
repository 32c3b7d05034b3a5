package kubesource

import (
	"fmt"
	"runtime"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// TestHeapPerService bounds the live heap a node agent keeps per Service
// of bench/kube's shape (100k Services in 100 namespaces, each with one
// EndpointSlice of one ready endpoint and one named port; one in ten
// headless, and every one past the first 20k): the informers' compact
// objects, the slices of each Service, and the name table built from
// them. The agent's peak memory is about (1 + GOGC/100) times this plus
// the binary, so a regression here shows up in make bench's VmHWM.
func TestHeapPerService(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds a 100k-Service table")
	}
	const n = 100000
	// A little above what the compact objects, the sharded table and the
	// shared endpoint addresses take (docs/testing.md has the figures).
	const maxPerService = 1380
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	// What the informers and the slice index hold, keyed as they are.
	services := make(map[string]any, n)
	slices := make(map[string]any, n)
	idx := &sliceIndex{m: map[string][]*endpointSlice{}}
	b, err := nametable.NewBuilder(nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.AddSource("kubernetes", 80)
	for i := range n {
		svc, es := benchObjects(i)
		so, err := transformService(svc)
		if err != nil {
			t.Fatal(err)
		}
		eo, err := transformSlice(es)
		if err != nil {
			t.Fatal(err)
		}
		key := svc.Namespace + "/" + svc.Name
		services[key], slices[key] = so, eo
		idx.set(key, eo)
		if err := b.Set("kubernetes", key, serviceHosts("cluster.local.", so.(*service), idx.of(key))); err != nil {
			t.Fatal(err)
		}
	}
	tab, err := b.Publish()
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := (after.HeapAlloc - before.HeapAlloc) / n
	t.Logf("%d Services, %d table hosts: %.1f MB live heap, %d bytes per Service", n, tab.Len(), float64(after.HeapAlloc-before.HeapAlloc)/1e6, per)
	if per > maxPerService {
		t.Errorf("%d bytes of live heap per Service, want <= %d", per, maxPerService)
	}
	runtime.KeepAlive(services)
	runtime.KeepAlive(slices)
	runtime.KeepAlive(b)
}

// benchObjects is Service i of bench/kube and its EndpointSlice, as the
// API server sends them.
func benchObjects(i int) (*corev1.Service, *discoveryv1.EndpointSlice) {
	ns, name := fmt.Sprintf("bench-%d", i%100), fmt.Sprintf("svc-%d", i)
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}}
	if i%10 == 9 || i >= 20000 {
		svc.Spec.ClusterIP = corev1.ClusterIPNone
	} else {
		svc.Spec.ClusterIP = fmt.Sprintf("10.%d.%d.%d", 96+i>>16, i>>8&0xff, i&0xff)
		svc.Spec.ClusterIPs = []string{svc.Spec.ClusterIP}
	}
	ready := true
	port, pname, proto := int32(80), "http", corev1.ProtocolTCP
	es := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: name}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{fmt.Sprintf("10.128.%d.%d", i>>8&0xff, i&0xff)},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
		Ports: []discoveryv1.EndpointPort{{Name: &pname, Port: &port, Protocol: &proto}},
	}
	return svc, es
}
