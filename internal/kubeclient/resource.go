package kubeclient

import (
	"context"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
)

// Resource lists, watches and gets the objects T (lists L) of one resource
// in one namespace ("" for all namespaces, or a cluster-scoped resource).
// Each request asks for protobuf, with JSON as fallback, unless the
// configuration names its own content types (as client-go's typed clients
// of built-in types).
type Resource[T, L runtime.Object] struct {
	client    rest.Interface
	resource  string
	namespace string
	newObject func() T
	newList   func() L
}

// List lists the objects that opts select.
func (r Resource[T, L]) List(ctx context.Context, opts metav1.ListOptions) (L, error) {
	list := r.newList()
	err := r.request().
		Timeout(timeout(opts.TimeoutSeconds)).
		VersionedParams(&opts, parameterCodec).
		Do(ctx).
		Into(list)
	return list, err
}

// Watch watches the objects that opts select.
func (r Resource[T, L]) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return r.request().
		Timeout(timeout(opts.TimeoutSeconds)).
		VersionedParams(&opts, parameterCodec).
		Watch(ctx)
}

// Get reads the object name.
func (r Resource[T, L]) Get(ctx context.Context, name string, opts metav1.GetOptions) (T, error) {
	obj := r.newObject()
	err := r.request().
		Name(name).
		VersionedParams(&opts, parameterCodec).
		Do(ctx).
		Into(obj)
	return obj, err
}

// request is a GET of the resource.
func (r Resource[T, L]) request() *rest.Request {
	return r.client.Get().
		UseProtobufAsDefault().
		NamespaceIfScoped(r.namespace, r.namespace != "").
		Resource(r.resource)
}

// timeout is a list's or a watch's own timeout: TimeoutSeconds, or none
// when unset (as client-go's typed clients, which set it either way and so
// drop the request's default, the configuration's Timeout).
func timeout(seconds *int64) time.Duration {
	if seconds == nil {
		return 0
	}
	return time.Duration(*seconds) * time.Second
}
