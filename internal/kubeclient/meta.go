package kubeclient

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Meta is the part of ObjectMeta an informer needs to key an object. The
// name sources' informers keep compact objects, not the API objects (a
// transform turns each API object into one as it arrives); each embeds
// Meta, which with a DeepCopyObject of its own makes it a runtime.Object
// the informer's cache and key function accept.
type Meta struct {
	Name, Namespace string
}

// GetObjectMeta implements metav1.ObjectMetaAccessor (the informer's key
// function reads namespace and name through it).
func (m *Meta) GetObjectMeta() metav1.Object {
	return &metav1.ObjectMeta{Name: m.Name, Namespace: m.Namespace}
}

// GetObjectKind implements runtime.Object.
func (m *Meta) GetObjectKind() schema.ObjectKind { return schema.EmptyObjectKind }

// Key is "namespace/name", the informer's key of a namespaced object.
func (m *Meta) Key() string { return m.Namespace + "/" + m.Name }
