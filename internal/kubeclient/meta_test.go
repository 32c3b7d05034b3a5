package kubeclient

import (
	"testing"

	"k8s.io/client-go/tools/cache"
)

// Meta's Key is the key the informer files a namespaced object under, so a
// source can find in its cache what it keyed itself.
func TestMetaKeyIsTheInformersKey(t *testing.T) {
	m := &Meta{Name: "web", Namespace: "team-a"}
	got, err := cache.MetaNamespaceKeyFunc(m)
	if err != nil {
		t.Fatal(err)
	}
	if got != m.Key() {
		t.Errorf("informer key %q, Key() %q", got, m.Key())
	}
}
