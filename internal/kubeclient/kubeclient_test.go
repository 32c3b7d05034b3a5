package kubeclient

import (
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// The scheme knows the three group-versions the agent reads and nothing
// else.
func TestSchemeHoldsOnlyTheGroupsTheAgentReads(t *testing.T) {
	var got []string
	for _, gv := range scheme.PreferredVersionAllGroups() {
		got = append(got, gv.String())
	}
	slices.Sort(got)
	want := []string{"apps/v1", "discovery.k8s.io/v1", "v1"}
	if !slices.Equal(got, want) {
		t.Errorf("group-versions %v, want %v", got, want)
	}
	for _, obj := range []runtime.Object{&corev1.Service{}, &corev1.PodList{}, &corev1.Secret{}, &corev1.Namespace{},
		&discoveryv1.EndpointSliceList{}, &appsv1.DaemonSet{}, &metav1.WatchEvent{}, &metav1.Status{}} {
		if _, _, err := scheme.ObjectKinds(obj); err != nil {
			t.Errorf("%T: %v", obj, err)
		}
	}
}

// List, get and watch options become the query parameters the API server
// reads, under every group-version of the scheme.
func TestParameterCodecEncodesOptionsForEveryGroup(t *testing.T) {
	five := int64(5)
	list := &metav1.ListOptions{FieldSelector: "spec.nodeName=node-a", LabelSelector: "istio/multiCluster=true",
		ResourceVersion: "42", TimeoutSeconds: &five, Watch: true, AllowWatchBookmarks: true}
	for _, gv := range []schema.GroupVersion{corev1.SchemeGroupVersion, discoveryv1.SchemeGroupVersion, appsv1.SchemeGroupVersion} {
		q, err := parameterCodec.EncodeParameters(list, gv)
		if err != nil {
			t.Fatalf("%s: %v", gv, err)
		}
		want := "allowWatchBookmarks=true&fieldSelector=spec.nodeName%3Dnode-a&labelSelector=istio%2FmultiCluster%3Dtrue&resourceVersion=42&timeoutSeconds=5&watch=true"
		if got := q.Encode(); got != want {
			t.Errorf("%s: list options as %s, want %s", gv, got, want)
		}
		q, err = parameterCodec.EncodeParameters(&metav1.GetOptions{ResourceVersion: "7"}, gv)
		if err != nil || q.Encode() != "resourceVersion=7" {
			t.Errorf("%s: get options as %q (%v), want resourceVersion=7", gv, q.Encode(), err)
		}
	}
}

// The codecs speak protobuf (what kubesource asks for), JSON (its
// fallback) and a protobuf list decodes into the typed list.
func TestCodecsDecodeProtobuf(t *testing.T) {
	var types []string
	var pb runtime.Serializer
	for _, info := range codecs.SupportedMediaTypes() {
		types = append(types, info.MediaType)
		if info.MediaType == runtime.ContentTypeProtobuf {
			pb = info.Serializer
		}
	}
	if pb == nil || !slices.Contains(types, runtime.ContentTypeJSON) {
		t.Fatalf("media types %v, want %s and %s", types, runtime.ContentTypeProtobuf, runtime.ContentTypeJSON)
	}
	in := &discoveryv1.EndpointSliceList{Items: []discoveryv1.EndpointSlice{{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "web-abcde"},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"10.244.1.10"}}},
	}}}
	var b strings.Builder
	if err := codecs.EncoderForVersion(pb, discoveryv1.SchemeGroupVersion).Encode(in, &b); err != nil {
		t.Fatal(err)
	}
	out, _, err := codecs.UniversalDeserializer().Decode([]byte(b.String()), nil, &discoveryv1.EndpointSliceList{})
	if err != nil {
		t.Fatal(err)
	}
	l, ok := out.(*discoveryv1.EndpointSliceList)
	if !ok || len(l.Items) != 1 || l.Items[0].Name != "web-abcde" || l.Items[0].Endpoints[0].Addresses[0] != "10.244.1.10" {
		t.Errorf("decoded %#v", out)
	}
}

func TestNew(t *testing.T) {
	t.Run("the caller's configuration is left alone", func(t *testing.T) {
		cfg := &rest.Config{Host: "https://127.0.0.1:6443"}
		cfg.ContentType = runtime.ContentTypeProtobuf
		c, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.UserAgent != "" || cfg.APIPath != "" || cfg.GroupVersion != nil || cfg.NegotiatedSerializer != nil || cfg.RateLimiter != nil {
			t.Errorf("New changed the caller's configuration: %+v", cfg)
		}
		for _, tc := range []struct {
			client rest.Interface
			want   schema.GroupVersion
		}{{c.core, corev1.SchemeGroupVersion}, {c.discovery, discoveryv1.SchemeGroupVersion}, {c.apps, appsv1.SchemeGroupVersion}} {
			if got := tc.client.APIVersion(); got != tc.want {
				t.Errorf("client of %s, want %s", got, tc.want)
			}
		}
	})
	t.Run("a QPS makes one rate limiter for every group", func(t *testing.T) {
		c, err := New(&rest.Config{Host: "https://127.0.0.1:6443", QPS: 20, Burst: 40})
		if err != nil {
			t.Fatal(err)
		}
		l := c.core.GetRateLimiter()
		if l == nil || l.QPS() != 20 || c.discovery.GetRateLimiter() != l || c.apps.GetRateLimiter() != l {
			t.Errorf("rate limiters %v %v %v, want one of 20 QPS", l, c.discovery.GetRateLimiter(), c.apps.GetRateLimiter())
		}
	})
	t.Run("the caller's rate limiter is used", func(t *testing.T) {
		rl := flowcontrol.NewFakeAlwaysRateLimiter()
		c, err := New(&rest.Config{Host: "https://127.0.0.1:6443", RateLimiter: rl})
		if err != nil {
			t.Fatal(err)
		}
		if c.core.GetRateLimiter() != rl || c.apps.GetRateLimiter() != rl {
			t.Error("the configuration's rate limiter is not the clients'")
		}
	})
	for _, tc := range []struct {
		name    string
		cfg     *rest.Config
		wantErr string
	}{
		{"no configuration", nil, "no API server configuration"},
		{"a QPS without a burst", &rest.Config{Host: "https://127.0.0.1:6443", QPS: 5}, "needs a burst"},
		{"a bad host", &rest.Config{Host: "https://[::1"}, "REST client of v1: host must be a URL"},
		{"a bad CA", &rest.Config{Host: "https://127.0.0.1:6443", TLSClientConfig: rest.TLSClientConfig{CAData: []byte("not PEM")}}, "HTTP client"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("err = %v, want one containing %q", err, tc.wantErr)
			}
		})
	}
}
