package kubesource

import (
	"net/netip"
	"slices"
	"testing"

	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
)

// The backends watch reports the endpoint addresses of the one Service it
// watches, from every slice of it, sorted and without duplicates, once per
// change, and nothing before the first backend (the informer may not have
// listed yet).
func TestServiceBackendsWatch(t *testing.T) {
	store := cache.NewStore(cache.MetaNamespaceKeyFunc)
	var got [][]netip.Addr
	s := &Source{}
	s.backends.setStore(store)
	s.WatchServiceBackends("kube-system/kube-dns", func(a []netip.Addr) { got = append(got, a) })
	h := s.backends.handler()
	slice := func(ns, name, svc string, addrs ...string) *endpointSlice {
		es := &endpointSlice{Meta: kubeclient.Meta{Name: name, Namespace: ns}, service: svc}
		for _, a := range addrs {
			es.endpoints = append(es.endpoints, endpoint{addrs: []netip.Addr{netip.MustParseAddr(a)}})
		}
		return es
	}
	add := func(es *endpointSlice) {
		if err := store.Add(es); err != nil {
			t.Fatal(err)
		}
		h.OnAdd(es, false)
	}
	if len(got) != 0 {
		t.Fatalf("reported %v before any backend", got)
	}
	add(slice("default", "web-1", "web", "10.0.0.9"))
	add(slice("kube-system", "kube-dns-a", "kube-dns", "10.0.1.2", "10.0.1.1"))
	add(slice("kube-system", "kube-dns-b", "kube-dns", "fd00::5", "10.0.1.1"))
	want := [][]netip.Addr{
		{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.1.2")},
		{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("10.0.1.2"), netip.MustParseAddr("fd00::5")},
	}
	if !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("reported %v, want %v", got, want)
	}
	// An unchanged set is not reported again; a deleted slice is.
	h.OnUpdate(nil, slice("kube-system", "kube-dns-b", "kube-dns", "fd00::5", "10.0.1.1"))
	gone := slice("kube-system", "kube-dns-a", "kube-dns")
	if err := store.Delete(gone); err != nil {
		t.Fatal(err)
	}
	h.OnDelete(cache.DeletedFinalStateUnknown{Key: "kube-system/kube-dns-a", Obj: gone})
	want = append(want, []netip.Addr{netip.MustParseAddr("10.0.1.1"), netip.MustParseAddr("fd00::5")})
	if !slices.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("reported %v, want %v", got, want)
	}
}
