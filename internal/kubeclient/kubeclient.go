// Package kubeclient is the agent's client of the Kubernetes API: one REST
// client per group-version the agent reads (core/v1, discovery.k8s.io/v1,
// apps/v1), over a scheme that registers only those, and typed list, watch
// and get of the objects the Kubernetes packages (kubesource, meshsource,
// kubelife) use. It stands in for client-go's clientset
// (k8s.io/client-go/kubernetes) and its scheme, which register every
// built-in API group: their code and init cost every agent megabytes of
// memory, in every mode, Kubernetes or not. The requests are the ones
// client-go's typed clients make.
package kubeclient

import (
	"errors"
	"fmt"
	"net/http"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

var (
	// scheme holds the types of core/v1, discovery.k8s.io/v1 and apps/v1,
	// and metav1's options and watch events under each of their versions.
	scheme = newScheme()
	// codecs decodes and encodes them as JSON, YAML and protobuf.
	codecs = serializer.NewCodecFactory(scheme)
	// parameterCodec turns list, get and watch options into query
	// parameters.
	parameterCodec = runtime.NewParameterCodec(scheme)
)

func newScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	// ListOptions, GetOptions, WatchEvent, Status... as the unversioned
	// "v1" the parameter codec and the watch decoder look them up under.
	metav1.AddToGroupVersion(s, schema.GroupVersion{Version: "v1"})
	utilruntime.Must(corev1.AddToScheme(s))
	utilruntime.Must(discoveryv1.AddToScheme(s))
	utilruntime.Must(appsv1.AddToScheme(s))
	return s
}

// Client holds the REST clients of the three group-versions. They share
// one HTTP client (one transport) and, when the configuration sets a QPS,
// one rate limiter, as client-go's clientset does.
type Client struct {
	core, discovery, apps rest.Interface
}

// New makes the clients from a copy of cfg: its host, credentials, TLS,
// content types, user agent (client-go's default when empty), rate limits
// and timeouts are kept. It contacts nothing.
func New(cfg *rest.Config) (*Client, error) {
	if cfg == nil {
		return nil, errors.New("no API server configuration")
	}
	base := rest.CopyConfig(cfg)
	if base.UserAgent == "" {
		base.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	if base.RateLimiter == nil && base.QPS > 0 {
		if base.Burst <= 0 {
			return nil, fmt.Errorf("QPS %v needs a burst above 0", base.QPS)
		}
		base.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(base.QPS, base.Burst)
	}
	hc, err := rest.HTTPClientFor(base)
	if err != nil {
		return nil, fmt.Errorf("HTTP client: %w", err)
	}
	c := &Client{}
	for _, g := range []struct {
		into    *rest.Interface
		apiPath string
		gv      schema.GroupVersion
	}{
		{&c.core, "/api", corev1.SchemeGroupVersion},
		{&c.discovery, "/apis", discoveryv1.SchemeGroupVersion},
		{&c.apps, "/apis", appsv1.SchemeGroupVersion},
	} {
		if *g.into, err = groupClient(base, hc, g.apiPath, g.gv); err != nil {
			return nil, fmt.Errorf("REST client of %s: %w", g.gv, err)
		}
	}
	return c, nil
}

// groupClient is the REST client of one group-version.
func groupClient(base *rest.Config, hc *http.Client, apiPath string, gv schema.GroupVersion) (*rest.RESTClient, error) {
	rc := rest.CopyConfig(base)
	rc.APIPath = apiPath
	rc.GroupVersion = &gv
	// As client-go's generated clients: CBOR joins the serializers only
	// when client-go's feature gates allow it; objects are decoded as
	// they come, never converted.
	rc.NegotiatedSerializer = rest.CodecFactoryForGeneratedClient(scheme, codecs).WithoutConversion()
	return rest.RESTClientForConfigAndClient(rc, hc)
}

// CoreV1 is the REST client of core/v1 ("/api/v1"), for informers built
// over it (cache.NewFilteredListWatchFromClient).
func (c *Client) CoreV1() rest.Interface { return c.core }

// AppsV1 is the REST client of apps/v1 ("/apis/apps/v1").
func (c *Client) AppsV1() rest.Interface { return c.apps }

// Services of namespace ("" for all).
func (c *Client) Services(namespace string) Resource[*corev1.Service, *corev1.ServiceList] {
	return Resource[*corev1.Service, *corev1.ServiceList]{c.core, "services", namespace,
		func() *corev1.Service { return &corev1.Service{} }, func() *corev1.ServiceList { return &corev1.ServiceList{} }}
}

// Pods of namespace ("" for all).
func (c *Client) Pods(namespace string) Resource[*corev1.Pod, *corev1.PodList] {
	return Resource[*corev1.Pod, *corev1.PodList]{c.core, "pods", namespace,
		func() *corev1.Pod { return &corev1.Pod{} }, func() *corev1.PodList { return &corev1.PodList{} }}
}

// Namespaces (cluster-scoped).
func (c *Client) Namespaces() Resource[*corev1.Namespace, *corev1.NamespaceList] {
	return Resource[*corev1.Namespace, *corev1.NamespaceList]{c.core, "namespaces", "",
		func() *corev1.Namespace { return &corev1.Namespace{} }, func() *corev1.NamespaceList { return &corev1.NamespaceList{} }}
}

// Secrets of namespace ("" for all).
func (c *Client) Secrets(namespace string) Resource[*corev1.Secret, *corev1.SecretList] {
	return Resource[*corev1.Secret, *corev1.SecretList]{c.core, "secrets", namespace,
		func() *corev1.Secret { return &corev1.Secret{} }, func() *corev1.SecretList { return &corev1.SecretList{} }}
}

// EndpointSlices of namespace ("" for all).
func (c *Client) EndpointSlices(namespace string) Resource[*discoveryv1.EndpointSlice, *discoveryv1.EndpointSliceList] {
	return Resource[*discoveryv1.EndpointSlice, *discoveryv1.EndpointSliceList]{c.discovery, "endpointslices", namespace,
		func() *discoveryv1.EndpointSlice { return &discoveryv1.EndpointSlice{} },
		func() *discoveryv1.EndpointSliceList { return &discoveryv1.EndpointSliceList{} }}
}
