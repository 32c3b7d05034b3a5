package kubesource

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

func ptr[T any](v T) *T { return &v }

func mustService(t *testing.T, s *corev1.Service) *service {
	t.Helper()
	o, err := transformService(s)
	if err != nil {
		t.Fatal(err)
	}
	return o.(*service)
}

func mustSlice(t *testing.T, s *discoveryv1.EndpointSlice) *endpointSlice {
	t.Helper()
	o, err := transformSlice(s)
	if err != nil {
		t.Fatal(err)
	}
	return o.(*endpointSlice)
}

func slice(name, svc string, typ discoveryv1.AddressType, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: typ, Ports: ports, Endpoints: eps,
	}
}

func ep(addr string, ready *bool, hostname string) discoveryv1.Endpoint {
	e := discoveryv1.Endpoint{Addresses: []string{addr}, Conditions: discoveryv1.EndpointConditions{Ready: ready}}
	if hostname != "" {
		e.Hostname = ptr(hostname)
	}
	return e
}

// render prints hosts in a stable, readable form.
func render(hs []nametable.Host) string {
	var b strings.Builder
	for _, h := range hs {
		fmt.Fprintf(&b, "%s", h.Name)
		if h.CNAME() != "" {
			fmt.Fprintf(&b, " CNAME %s", h.CNAME())
		}
		for _, a := range append(h.V4[:len(h.V4):len(h.V4)], h.V6...) {
			fmt.Fprintf(&b, " %s", a)
		}
		for _, p := range h.Ports {
			fmt.Fprintf(&b, " _%s._%s:%d", p.Name, p.Protocol, p.Port)
			if p.Target != "" {
				fmt.Fprintf(&b, "->%s", p.Target)
			}
		}
		if h.Merge {
			b.WriteString(" merge")
		}
		if h.NoPTR {
			b.WriteString(" noptr")
		}
		b.WriteString("\n")
	}
	return b.String()
}

func TestServiceHosts(t *testing.T) {
	tcp := []discoveryv1.EndpointPort{{Name: ptr("sql"), Port: ptr[int32](5432)}, {Port: ptr[int32](9)}}
	tests := []struct {
		name   string
		svc    *corev1.Service
		slices []*discoveryv1.EndpointSlice
		want   string
	}{
		{
			name: "dual-stack ClusterIP with named and unnamed ports",
			svc: &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "ns"}, Spec: corev1.ServiceSpec{
				ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10", "fd00:10:96::a"},
				Ports: []corev1.ServicePort{{Name: "http", Port: 80}, {Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP}, {Port: 8080}}}},
			want: "web.ns.svc.cluster.local. 10.96.0.10 fd00:10:96::a _http._tcp:80 _dns._udp:53\n",
		},
		{
			name: "ExternalName",
			svc: &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "ext", Namespace: "ns"}, Spec: corev1.ServiceSpec{
				Type: corev1.ServiceTypeExternalName, ExternalName: "db.example.org"}},
			want: "ext.ns.svc.cluster.local. CNAME db.example.org\n",
		},
		{
			name: "headless: ready endpoints only, hostnames, dashed names, SRV per endpoint",
			svc:  &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: "ns"}, Spec: corev1.ServiceSpec{ClusterIP: "None"}},
			slices: []*discoveryv1.EndpointSlice{
				slice("db-b", "db", discoveryv1.AddressTypeIPv6, tcp, ep("fd00:244::7", ptr(true), "")),
				slice("db-a", "db", discoveryv1.AddressTypeIPv4, tcp,
					ep("10.244.1.5", ptr(true), "db-0"), ep("10.244.1.6", ptr(false), "db-1"), ep("10.244.2.7", nil, "")),
				slice("db-fqdn", "db", discoveryv1.AddressTypeFQDN, tcp, ep("x.example.org", ptr(true), "")),
			},
			want: "db.ns.svc.cluster.local. 10.244.1.5 10.244.2.7 fd00:244::7 _sql._tcp:5432->db-0.db.ns.svc.cluster.local. _sql._tcp:5432->10-244-2-7.db.ns.svc.cluster.local. _sql._tcp:5432->fd00-244--7.db.ns.svc.cluster.local. merge noptr\n" +
				"db-0.db.ns.svc.cluster.local. 10.244.1.5 merge\n" +
				"10-244-2-7.db.ns.svc.cluster.local. 10.244.2.7 merge\n" +
				"fd00-244--7.db.ns.svc.cluster.local. fd00:244::7 merge\n",
		},
		{
			name: "headless with publishNotReadyAddresses answers every endpoint; duplicates across slices once",
			svc: &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: "ns"}, Spec: corev1.ServiceSpec{
				ClusterIP: "None", PublishNotReadyAddresses: true}},
			slices: []*discoveryv1.EndpointSlice{
				slice("a", "db", discoveryv1.AddressTypeIPv4, nil, ep("10.244.1.5", ptr(true), "db-0"), ep("10.244.1.6", ptr(false), "db-1")),
				slice("b", "db", discoveryv1.AddressTypeIPv4, nil, ep("10.244.1.6", ptr(false), "db-1")),
			},
			want: "db.ns.svc.cluster.local. 10.244.1.5 10.244.1.6 merge noptr\n" +
				"db-0.db.ns.svc.cluster.local. 10.244.1.5 merge\n" +
				"db-1.db.ns.svc.cluster.local. 10.244.1.6 merge\n",
		},
		{
			name: "headless without ready endpoints has no data",
			svc:  &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: "ns"}, Spec: corev1.ServiceSpec{ClusterIP: "None"}},
			slices: []*discoveryv1.EndpointSlice{
				slice("a", "db", discoveryv1.AddressTypeIPv4, nil, ep("10.244.1.6", ptr(false), "db-1")),
			},
			want: "db.ns.svc.cluster.local. merge noptr\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var eps []*endpointSlice
			for _, s := range tt.slices {
				eps = append(eps, mustSlice(t, s))
			}
			objects := func() string { // the informer's objects, which the hosts share addresses with
				var b strings.Builder
				for _, es := range eps {
					fmt.Fprintf(&b, "%+v\n", es.endpoints)
				}
				return b.String()
			}
			before := objects()
			svc := mustService(t, tt.svc)
			got := render(serviceHosts("cluster.local.", svc, eps))
			if got != tt.want {
				t.Fatalf("hosts\n--- got\n%s--- want\n%s", got, tt.want)
			}
			if again := render(serviceHosts("cluster.local.", svc, eps)); again != got {
				t.Fatalf("a second computation differs:\n%s", again)
			}
			if after := objects(); after != before {
				t.Fatalf("the informer's objects changed:\n%s\nwas\n%s", after, before)
			}
		})
	}
}

func TestTransformPod(t *testing.T) {
	running := corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "10.244.0.5", PodIPs: []corev1.PodIP{{IP: "10.244.0.5"}, {IP: "fd00::5"}}}
	for _, tt := range []struct {
		name string
		pod  corev1.Pod
		want string
	}{
		{"running", corev1.Pod{Status: running}, "[10.244.0.5 fd00::5]"},
		{"host network", corev1.Pod{Spec: corev1.PodSpec{HostNetwork: true}, Status: running}, "[]"},
		{"finished", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodSucceeded, PodIP: "10.244.0.5"}}, "[]"},
		{"pending without IP", corev1.Pod{Status: corev1.PodStatus{Phase: corev1.PodPending}}, "[]"},
	} {
		o, err := transformPod(&tt.pod)
		if err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(o.(*pod).ips); got != tt.want {
			t.Errorf("%s: ips %s, want %s", tt.name, got, tt.want)
		}
	}
}

// The compact Pod and Namespace keep their meshdns.io/ annotations (upstream
// budget overrides) and no others.
func TestTransformKeepsOwnAnnotations(t *testing.T) {
	ann := map[string]string{"meshdns.io/upstream-qps": "50", "kubectl.kubernetes.io/last-applied-configuration": "{...}", "app": "x"}
	want := "map[meshdns.io/upstream-qps:50]"
	p, err := transformPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "ns", Annotations: ann}})
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(p.(*pod).ann); got != want {
		t.Errorf("pod annotations %s, want %s", got, want)
	}
	n, err := transformNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns", Annotations: ann}})
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(n.(*namespace).ann); got != want {
		t.Errorf("namespace annotations %s, want %s", got, want)
	}
	if p, _ := transformPod(&corev1.Pod{}); p.(*pod).ann != nil {
		t.Errorf("a pod without annotations keeps %v", p.(*pod).ann)
	}
}
