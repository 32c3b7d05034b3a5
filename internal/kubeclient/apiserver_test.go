package kubeclient_test

import (
	"net/http"
	"net/url"
	"slices"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
)

const (
	protobuf     = "application/vnd.kubernetes.protobuf"
	protobufJSON = "application/vnd.kubernetes.protobuf,application/json"
)

// exchange is one request the client sent and what the server answered.
type exchange struct {
	path, accept, userAgent string
	query                   url.Values
	contentType             string // of the response
}

// recorder sees every request of a client on the wire side of client-go's
// wrappers (user agent and credentials set).
type recorder struct {
	mu   sync.Mutex
	seen []exchange
}

func (r *recorder) wrap(rc *rest.Config) *rest.Config {
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(req)
			if err == nil {
				r.mu.Lock()
				r.seen = append(r.seen, exchange{path: req.URL.Path, query: req.URL.Query(), accept: req.Header.Get("Accept"),
					userAgent: req.Header.Get("User-Agent"), contentType: resp.Header.Get("Content-Type")})
				r.mu.Unlock()
			}
			return resp, err
		})
	}
	return rc
}

// last is the last request to path.
func (r *recorder) last(t *testing.T, path string) exchange {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range slices.Backward(r.seen) {
		if e.path == path {
			return e
		}
	}
	t.Fatalf("no request to %s", path)
	return exchange{}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// cluster is a control plane with one object of each kind the agent reads.
type cluster struct {
	cp  *kubetest.ControlPlane
	svc *corev1.Service
}

func startCluster(t *testing.T) *cluster {
	cp := kubetest.Start(t, kubetest.Options{})
	cp.EnsureNamespace(t, "kc")
	svc := cp.CreateService(t, kubetest.Service{Namespace: "kc", Name: "web"})
	cp.CreatePod(t, kubetest.Pod{Namespace: "kc", Name: "web-a", Node: "node-a", IPs: []string{"10.244.1.10"}, Ready: true})
	cp.CreatePod(t, kubetest.Pod{Namespace: "kc", Name: "web-b", Node: "node-b", IPs: []string{"10.244.2.10"}, Ready: true})
	cp.CreateDaemonSet(t, "kc", "agent")
	ctx := kubetest.OpContext(t)
	admin := cp.AdminClient()
	port, proto := int32(80), corev1.ProtocolTCP
	if _, err := admin.DiscoveryV1().EndpointSlices("kc").Create(ctx, &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "web-x", Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"10.244.1.10"}}},
		Ports:       []discoveryv1.EndpointPort{{Port: &port, Protocol: &proto}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, s := range []struct {
		name   string
		labels map[string]string
	}{{"remote", map[string]string{"istio/multiCluster": "true"}}, {"other", nil}} {
		if _, err := admin.CoreV1().Secrets("kc").Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: s.name, Labels: s.labels},
			Data:       map[string][]byte{"east": []byte("kubeconfig")},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return &cluster{cp: cp, svc: svc}
}

func (c *cluster) client(t *testing.T, rec *recorder, contentType, accept, userAgent string) *kubeclient.Client {
	rc := rec.wrap(c.cp.RESTConfig(t, kubetest.Admin))
	rc.ContentType, rc.AcceptContentTypes, rc.UserAgent = contentType, accept, userAgent
	kc, err := kubeclient.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	return kc
}

// What the Kubernetes sources ask of the API server, asked of a real one.
func TestAgainstAPIServer(t *testing.T) {
	c := startCluster(t)

	// kubesource's configuration: protobuf with JSON as fallback. The
	// server answers lists, gets and watches in protobuf.
	t.Run("protobuf as the configuration asks", func(t *testing.T) {
		var rec recorder
		kc := c.client(t, &rec, protobuf, protobufJSON, "meshdns-ebpf")
		list, err := kc.Services("").List(kubetest.OpContext(t), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(list.Items, func(s corev1.Service) bool { return s.Namespace == "kc" && s.Name == "web" }) {
			t.Errorf("the list of every namespace's Services lacks kc/web: %d items", len(list.Items))
		}
		e := rec.last(t, "/api/v1/services")
		if e.accept != protobufJSON || e.contentType != protobuf || e.userAgent != "meshdns-ebpf" {
			t.Errorf("list sent Accept %q and User-Agent %q, got Content-Type %q; want %q, meshdns-ebpf, %q",
				e.accept, e.userAgent, e.contentType, protobufJSON, protobuf)
		}
		if _, err := kc.Services("kc").Get(kubetest.OpContext(t), "web", metav1.GetOptions{}); err != nil {
			t.Fatal(err)
		}
		if e := rec.last(t, "/api/v1/namespaces/kc/services/web"); e.contentType != protobuf {
			t.Errorf("get answered with Content-Type %q, want %q", e.contentType, protobuf)
		}
	})

	// Without content types in the configuration (kubelife, the cluster
	// DNS lookup) the requests still prefer protobuf, as client-go's typed
	// clients of built-in types do.
	t.Run("protobuf by default", func(t *testing.T) {
		var rec recorder
		kc := c.client(t, &rec, "", "", "")
		if _, err := kc.Pods("kc").Get(kubetest.OpContext(t), "web-a", metav1.GetOptions{}); err != nil {
			t.Fatal(err)
		}
		e := rec.last(t, "/api/v1/namespaces/kc/pods/web-a")
		if e.accept != protobufJSON || e.contentType != protobuf || e.userAgent != rest.DefaultKubernetesUserAgent() {
			t.Errorf("get sent Accept %q and User-Agent %q, got Content-Type %q; want %q, %q, %q",
				e.accept, e.userAgent, e.contentType, protobufJSON, rest.DefaultKubernetesUserAgent(), protobuf)
		}
	})

	// A configuration that names JSON gets JSON.
	t.Run("JSON when the configuration asks for it", func(t *testing.T) {
		var rec recorder
		kc := c.client(t, &rec, "application/json", "application/json", "")
		list, err := kc.EndpointSlices("kc").List(kubetest.OpContext(t), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Items) != 1 || list.Items[0].Name != "web-x" || list.Items[0].Endpoints[0].Addresses[0] != "10.244.1.10" {
			t.Errorf("EndpointSlices of kc: %+v", list.Items)
		}
		if e := rec.last(t, "/apis/discovery.k8s.io/v1/namespaces/kc/endpointslices"); e.accept != "application/json" || e.contentType != "application/json" {
			t.Errorf("list sent Accept %q, got Content-Type %q; want application/json both", e.accept, e.contentType)
		}
	})

	t.Run("selectors and timeouts", func(t *testing.T) {
		var rec recorder
		kc := c.client(t, &rec, protobuf, protobufJSON, "")
		ten := int64(10)
		pods, err := kc.Pods("").List(kubetest.OpContext(t), metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("spec.nodeName", "node-a").String(), TimeoutSeconds: &ten})
		if err != nil {
			t.Fatal(err)
		}
		if len(pods.Items) != 1 || pods.Items[0].Name != "web-a" {
			t.Errorf("pods of node-a: %d, want web-a alone", len(pods.Items))
		}
		q := rec.last(t, "/api/v1/pods").query
		if q.Get("fieldSelector") != "spec.nodeName=node-a" || q.Get("timeoutSeconds") != "10" || q.Get("timeout") != "10s" {
			t.Errorf("list query %v", q)
		}
		secrets, err := kc.Secrets("kc").List(kubetest.OpContext(t), metav1.ListOptions{LabelSelector: "istio/multiCluster=true"})
		if err != nil {
			t.Fatal(err)
		}
		if len(secrets.Items) != 1 || secrets.Items[0].Name != "remote" || string(secrets.Items[0].Data["east"]) != "kubeconfig" {
			t.Errorf("remote secrets: %+v", secrets.Items)
		}
		// Without TimeoutSeconds a list has no timeout of its own, not the
		// configuration's (30 s in kubetest's).
		if q := rec.last(t, "/api/v1/namespaces/kc/secrets").query; q.Has("timeout") || q.Has("timeoutSeconds") {
			t.Errorf("list without TimeoutSeconds sent %v", q)
		}
		_, err = kc.Services("kc").Get(kubetest.OpContext(t), "nothing", metav1.GetOptions{})
		if !apierrors.IsNotFound(err) {
			t.Errorf("get of a missing Service: %v, want not found", err)
		}
	})

	t.Run("watch", func(t *testing.T) {
		var rec recorder
		kc := c.client(t, &rec, protobuf, protobufJSON, "")
		ctx := kubetest.OpContext(t)
		list, err := kc.Services("kc").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		w, err := kc.Services("kc").Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Stop()
		c.cp.CreateService(t, kubetest.Service{Namespace: "kc", Name: "api"})
		select {
		case ev := <-w.ResultChan():
			svc, ok := ev.Object.(*corev1.Service)
			if ev.Type != watch.Added || !ok || svc.Name != "api" {
				t.Errorf("event %s %T, want Added *v1.Service api", ev.Type, ev.Object)
			}
		case <-ctx.Done():
			t.Fatal("no event for the new Service")
		}
		e := rec.last(t, "/api/v1/namespaces/kc/services")
		if e.query.Get("watch") != "true" || e.contentType != protobuf+";stream=watch" {
			t.Errorf("watch sent %v, got Content-Type %q", e.query, e.contentType)
		}
	})

	// kubelife's informers are built over the REST clients.
	t.Run("informers over the REST clients", func(t *testing.T) {
		var rec recorder
		kc := c.client(t, &rec, "", "", "")
		byName := func(name string) func(*metav1.ListOptions) {
			return func(o *metav1.ListOptions) {
				o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
			}
		}
		nsList, err := cache.NewFilteredListWatchFromClient(kc.CoreV1(), "namespaces", "", byName("kc")).ListWithContext(kubetest.OpContext(t), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if l, ok := nsList.(*corev1.NamespaceList); !ok || len(l.Items) != 1 || l.Items[0].Name != "kc" {
			t.Errorf("namespaces named kc: %#v", nsList)
		}
		dsList, err := cache.NewFilteredListWatchFromClient(kc.AppsV1(), "daemonsets", "kc", byName("agent")).ListWithContext(kubetest.OpContext(t), metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if l, ok := dsList.(*appsv1.DaemonSetList); !ok || len(l.Items) != 1 || l.Items[0].Name != "agent" {
			t.Errorf("daemonsets named agent: %#v", dsList)
		}
		rec.last(t, "/apis/apps/v1/namespaces/kc/daemonsets")
	})
}
