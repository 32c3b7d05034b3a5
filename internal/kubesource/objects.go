package kubesource

import (
	"net/netip"
	"strconv"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// The informers keep these compact objects, not the API objects: a
// transform turns each API object into one as it arrives, so an informer
// cache of 100k Services holds only what DNS needs (names, addresses,
// ports, readiness). They are immutable once made.

type port struct {
	name, proto string
	port        uint16
}

// service is a Service as DNS sees it.
type service struct {
	kubeclient.Meta
	clusterIPs      []netip.Addr
	headless        bool
	externalName    string
	publishNotReady bool
	ports           []port
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (s *service) DeepCopyObject() runtime.Object { return s }

// endpointSlice is an EndpointSlice as DNS sees it: its Service, ports and
// endpoints.
type endpointSlice struct {
	kubeclient.Meta
	service   string // the kubernetes.io/service-name label
	ports     []port
	endpoints []endpoint
}

type endpoint struct {
	addrs    []netip.Addr
	hostname string
	ready    bool
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (s *endpointSlice) DeepCopyObject() runtime.Object { return s }

// pod is a Pod of this node: its IPs are clients of its namespace.
type pod struct {
	kubeclient.Meta
	uid        string
	ips        []netip.Addr
	containers map[string]string // container id (without the runtime prefix) -> name
	ann        map[string]string // its meshdns.io/ annotations (nil: none)
	labels     map[string]string // what egress policies select it by
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (p *pod) DeepCopyObject() runtime.Object { return p }

// intern shares the strings and port lists many objects repeat
// (namespaces, port names, the same ports on thousands of Services): the
// informer caches hold one copy.
var intern = struct {
	sync.Mutex
	strs      map[string]string
	ports     map[string][]port
	hostPorts map[*port][]nametable.HostPort // by the interned port list's first element
}{strs: map[string]string{}, ports: map[string][]port{}, hostPorts: map[*port][]nametable.HostPort{}}

func internStr(s string) string {
	intern.Lock()
	defer intern.Unlock()
	if v, ok := intern.strs[s]; ok {
		return v
	}
	if len(intern.strs) < 1<<16 {
		intern.strs[s] = s
	}
	return s
}

func internPorts(ps []port) []port {
	if len(ps) == 0 {
		return nil
	}
	var b strings.Builder
	for _, p := range ps {
		b.WriteString(p.name)
		b.WriteByte('/')
		b.WriteString(p.proto)
		b.WriteByte('/')
		b.WriteString(strconv.Itoa(int(p.port)))
		b.WriteByte(',')
	}
	k := b.String()
	intern.Lock()
	defer intern.Unlock()
	if v, ok := intern.ports[k]; ok {
		return v
	}
	if len(intern.ports) < 1<<16 {
		intern.ports[k] = ps
	}
	return ps
}

func parseAddrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		if a, err := netip.ParseAddr(s); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

func protoName(p corev1.Protocol) string {
	switch p {
	case corev1.ProtocolUDP:
		return "udp"
	case corev1.ProtocolSCTP:
		return "sctp"
	}
	return "tcp"
}

// transformService keeps what DNS needs of a Service.
func transformService(obj any) (any, error) {
	s, ok := obj.(*corev1.Service)
	if !ok {
		return obj, nil // already transformed, or a tombstone
	}
	out := &service{
		Meta:            kubeclient.Meta{Name: s.Name, Namespace: internStr(s.Namespace)},
		publishNotReady: s.Spec.PublishNotReadyAddresses,
	}
	switch {
	case s.Spec.Type == corev1.ServiceTypeExternalName:
		out.externalName = s.Spec.ExternalName
	case s.Spec.ClusterIP == corev1.ClusterIPNone:
		out.headless = true
	default:
		ips := s.Spec.ClusterIPs
		if len(ips) == 0 && s.Spec.ClusterIP != "" {
			ips = []string{s.Spec.ClusterIP}
		}
		out.clusterIPs = parseAddrs(ips...)
	}
	for _, p := range s.Spec.Ports {
		if p.Name == "" || p.Port <= 0 || p.Port > 65535 {
			continue // SRV records need a named port
		}
		out.ports = append(out.ports, port{name: internStr(strings.ToLower(p.Name)), proto: protoName(p.Protocol), port: uint16(p.Port)})
	}
	out.ports = internPorts(out.ports)
	return out, nil
}

// transformSlice keeps what DNS needs of an EndpointSlice.
func transformSlice(obj any) (any, error) {
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj, nil
	}
	out := &endpointSlice{
		Meta:    kubeclient.Meta{Name: s.Name, Namespace: internStr(s.Namespace)},
		service: s.Labels[discoveryv1.LabelServiceName],
	}
	if strings.HasPrefix(out.Name, out.service) {
		// The controller names slices <service>-<suffix>: share the name's bytes.
		out.service = out.Name[:len(out.service)]
	}
	if s.AddressType != discoveryv1.AddressTypeIPv4 && s.AddressType != discoveryv1.AddressTypeIPv6 {
		return out, nil // FQDN slices have no addresses DNS can serve
	}
	for _, p := range s.Ports {
		if p.Name == nil || *p.Name == "" || p.Port == nil || *p.Port <= 0 || *p.Port > 65535 {
			continue
		}
		proto := corev1.ProtocolTCP
		if p.Protocol != nil {
			proto = *p.Protocol
		}
		out.ports = append(out.ports, port{name: internStr(strings.ToLower(*p.Name)), proto: protoName(proto), port: uint16(*p.Port)})
	}
	out.ports = internPorts(out.ports)
	for _, e := range s.Endpoints {
		ep := endpoint{
			addrs: parseAddrs(e.Addresses...),
			// A nil condition means unknown, which consumers treat as ready.
			ready: e.Conditions.Ready == nil || *e.Conditions.Ready,
		}
		if e.Hostname != nil {
			ep.hostname = strings.ToLower(*e.Hostname)
		}
		if len(ep.addrs) > 0 {
			out.endpoints = append(out.endpoints, ep)
		}
	}
	return out, nil
}

// namespace is a Namespace's meshdns.io/ annotations (per-workload budget
// overrides, internal/budgetoverride).
type namespace struct {
	kubeclient.Meta
	ann map[string]string
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (n *namespace) DeepCopyObject() runtime.Object { return n }

// annotationPrefix is the annotations the compact objects keep.
const annotationPrefix = "meshdns.io/"

// ownAnnotations returns the meshdns.io/ annotations of ann, nil when none.
func ownAnnotations(ann map[string]string) map[string]string {
	var out map[string]string
	for k, v := range ann {
		if strings.HasPrefix(k, annotationPrefix) {
			if out == nil {
				out = map[string]string{}
			}
			out[k] = v
		}
	}
	return out
}

func transformNamespace(obj any) (any, error) {
	n, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	return &namespace{Meta: kubeclient.Meta{Name: n.Name}, ann: ownAnnotations(n.Annotations)}, nil
}

// transformPod keeps a Pod's IPs, and none for a Pod whose IPs are not its
// own (host network) or no longer its own (finished).
func transformPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	out := &pod{Meta: kubeclient.Meta{Name: p.Name, Namespace: internStr(p.Namespace)}, uid: string(p.UID), labels: p.Labels}
	if m := p.Annotations[corev1.MirrorPodAnnotationKey]; m != "" {
		out.uid = m // a static Pod's mirror: kubelet's cgroup carries the static Pod's UID
	}
	out.ann = ownAnnotations(p.Annotations)
	for _, list := range [][]corev1.ContainerStatus{p.Status.InitContainerStatuses, p.Status.ContainerStatuses, p.Status.EphemeralContainerStatuses} {
		for _, cs := range list {
			if _, id, ok := strings.Cut(cs.ContainerID, "://"); ok && id != "" {
				if out.containers == nil {
					out.containers = map[string]string{}
				}
				out.containers[id] = cs.Name
			}
		}
	}
	if p.Spec.HostNetwork || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		return out, nil
	}
	var ips []string
	for _, pip := range p.Status.PodIPs {
		ips = append(ips, pip.IP)
	}
	if len(ips) == 0 && p.Status.PodIP != "" {
		ips = []string{p.Status.PodIP}
	}
	out.ips = parseAddrs(ips...)
	return out, nil
}
