package kubetest

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// WaitTimeout bounds the helpers' waits for the controllers (EndpointSlices,
// CRDs). Waits poll and return as soon as the condition holds.
const WaitTimeout = 30 * time.Second

// Service describes a Service for CreateService.
type Service struct {
	Namespace, Name string
	// Headless sets clusterIP: None.
	Headless bool
	// DualStack asks for both families (ipFamilyPolicy RequireDualStack, IPv4
	// first); a headless Service then gets one EndpointSlice per family.
	DualStack bool
	// ExternalName makes a type ExternalName Service (a CNAME to this name) with
	// no selector and no ports.
	ExternalName string
	// Ports default to one port "http" 80/TCP (none for ExternalName).
	Ports []corev1.ServicePort
	// Selector defaults to app=<Name> (none for ExternalName).
	Selector map[string]string
	// PublishNotReadyAddresses marks every endpoint ready, whatever its Pod says.
	PublishNotReadyAddresses bool
	Labels                   map[string]string
	// Annotations, e.g. Istio's networking.istio.io/exportTo.
	Annotations map[string]string
}

// CreateService creates s and returns it as stored (with its allocated ClusterIPs).
func (cp *ControlPlane) CreateService(t testing.TB, s Service) *corev1.Service {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, Labels: s.Labels, Annotations: s.Annotations},
		Spec:       corev1.ServiceSpec{PublishNotReadyAddresses: s.PublishNotReadyAddresses},
	}
	if s.ExternalName != "" {
		svc.Spec.Type = corev1.ServiceTypeExternalName
		svc.Spec.ExternalName = s.ExternalName
		svc.Spec.Ports = s.Ports
	} else {
		svc.Spec.Type = corev1.ServiceTypeClusterIP
		svc.Spec.Selector = s.Selector
		if svc.Spec.Selector == nil {
			svc.Spec.Selector = map[string]string{"app": s.Name}
		}
		svc.Spec.Ports = s.Ports
		if svc.Spec.Ports == nil {
			svc.Spec.Ports = []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(80)}}
		}
	}
	if s.Headless {
		svc.Spec.ClusterIP = corev1.ClusterIPNone
	}
	if s.DualStack {
		policy := corev1.IPFamilyPolicyRequireDualStack
		svc.Spec.IPFamilyPolicy = &policy
		svc.Spec.IPFamilies = []corev1.IPFamily{corev1.IPv4Protocol, corev1.IPv6Protocol}
	}
	out, err := cp.client.CoreV1().Services(s.Namespace).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: create Service %s/%s: %v", s.Namespace, s.Name, err)
	}
	return out
}

// DeleteService deletes a Service; the garbage collector (Options.ControllerManager)
// then deletes its EndpointSlices.
func (cp *ControlPlane) DeleteService(t testing.TB, namespace, name string) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	if err := cp.client.CoreV1().Services(namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("kubetest: delete Service %s/%s: %v", namespace, name, err)
	}
}

// Pod describes a Pod for CreatePod. No kubelet runs: the Pod is an API object whose
// status CreatePod sets as a kubelet would (phase Running, IPs, the Ready condition).
type Pod struct {
	Namespace, Name string
	// Node is spec.nodeName (required). CreatePod creates the Node object when it
	// does not exist: the EndpointSlice controller skips Pods whose Node is missing
	// (unless the Service publishes not-ready addresses).
	Node string
	// Labels select the Pod into Services (e.g. app=<service name>).
	Labels map[string]string
	// IPs are status.podIPs, at most one per family; the first is status.podIP.
	// Without IPs a Pod is in no EndpointSlice.
	IPs []string
	// Ready is the Ready condition.
	Ready bool
	// Hostname and Subdomain give the endpoint a hostname when Subdomain names a
	// headless Service of the Pod's namespace (<hostname>.<subdomain>.<ns>.svc).
	Hostname, Subdomain string
	// Ports are the container's ports (for a Service's targetPort by name).
	Ports []corev1.ContainerPort
	// HostNetwork is spec.hostNetwork.
	HostNetwork bool
	// ContainerID, when set, is the status's id of the container "app"
	// ("containerd://<ContainerID>"), as a kubelet reports it.
	ContainerID string
	// Controller is the Pod's controller (a DaemonSet's pods: the
	// DaemonSet; see CreateDaemonSet).
	Controller *metav1.OwnerReference
}

// CreatePod creates p (and its Node if missing), sets its status and returns it.
func (cp *ControlPlane) CreatePod(t testing.TB, p Pod) *corev1.Pod {
	t.Helper()
	if p.Node == "" {
		t.Fatalf("kubetest: Pod %s/%s needs a Node", p.Namespace, p.Name)
	}
	cp.EnsureNode(t, p.Node)
	ctx, cancel := opContext(t)
	defer cancel()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: p.Name, Labels: p.Labels},
		Spec: corev1.PodSpec{
			NodeName:    p.Node,
			Hostname:    p.Hostname,
			Subdomain:   p.Subdomain,
			HostNetwork: p.HostNetwork,
			Containers: []corev1.Container{{
				Name:  "app",
				Image: "kubetest.invalid/app:none", // never pulled: no kubelet runs
				Ports: p.Ports,
			}},
		},
	}
	if p.Controller != nil {
		pod.OwnerReferences = []metav1.OwnerReference{*p.Controller}
	}
	created, err := cp.client.CoreV1().Pods(p.Namespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: create Pod %s/%s: %v", p.Namespace, p.Name, err)
	}
	created.Status = podStatus(t, p.IPs, p.Ready)
	if p.ContainerID != "" {
		created.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", ContainerID: "containerd://" + p.ContainerID, Ready: p.Ready}}
	}
	out, err := cp.client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		t.Fatalf("kubetest: set status of Pod %s/%s: %v", p.Namespace, p.Name, err)
	}
	return out
}

// podStatus is a running Pod's status as a kubelet reports it.
func podStatus(t testing.TB, ips []string, ready bool) corev1.PodStatus {
	t.Helper()
	now := metav1.Now()
	st := corev1.PodStatus{
		Phase:     corev1.PodRunning,
		StartTime: &now,
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.ContainersReady, Status: conditionStatus(ready), LastTransitionTime: now},
			{Type: corev1.PodReady, Status: conditionStatus(ready), LastTransitionTime: now},
		},
	}
	for _, ip := range ips {
		if _, err := netip.ParseAddr(ip); err != nil {
			t.Fatalf("kubetest: pod IP %q: %v", ip, err)
		}
		st.PodIPs = append(st.PodIPs, corev1.PodIP{IP: ip})
	}
	if len(ips) > 0 {
		st.PodIP = ips[0]
	}
	return st
}

func conditionStatus(b bool) corev1.ConditionStatus {
	if b {
		return corev1.ConditionTrue
	}
	return corev1.ConditionFalse
}

// SetPodReady sets a Pod's Ready (and ContainersReady) condition, as a kubelet does
// when its readiness probe flips.
func (cp *ControlPlane) SetPodReady(t testing.TB, namespace, name string, ready bool) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	pods := cp.client.CoreV1().Pods(namespace)
	pod, err := pods.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("kubetest: get Pod %s/%s: %v", namespace, name, err)
	}
	now := metav1.Now()
	for i, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady || c.Type == corev1.ContainersReady {
			pod.Status.Conditions[i].Status = conditionStatus(ready)
			pod.Status.Conditions[i].LastTransitionTime = now
		}
	}
	if _, err := pods.UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("kubetest: set Pod %s/%s ready=%v: %v", namespace, name, ready, err)
	}
}

// DeletePod deletes a Pod at once (grace period 0). With a grace period and no
// kubelet to confirm, a Pod would stay Terminating forever.
func (cp *ControlPlane) DeletePod(t testing.TB, namespace, name string) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	zero := int64(0)
	if err := cp.client.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatalf("kubetest: delete Pod %s/%s: %v", namespace, name, err)
	}
}

// DeletePodGracefully deletes a Pod as kubectl delete pod does: it gets a
// deletionTimestamp and, with no kubelet to confirm, stays Terminating.
func (cp *ControlPlane) DeletePodGracefully(t testing.TB, namespace, name string) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	if err := cp.client.CoreV1().Pods(namespace).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("kubetest: delete Pod %s/%s: %v", namespace, name, err)
	}
}

// CreateDaemonSet creates a DaemonSet (in an existing namespace) and returns
// it with the controller reference its pods carry (Pod.Controller). No
// controller runs it: its pods are the ones a test creates.
func (cp *ControlPlane) CreateDaemonSet(t testing.TB, namespace, name string) (*appsv1.DaemonSet, *metav1.OwnerReference) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	labels := map[string]string{"app": name}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "kubetest.invalid/app:none"}}},
			},
		},
	}
	out, err := cp.client.AppsV1().DaemonSets(namespace).Create(ctx, ds, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("kubetest: create DaemonSet %s/%s: %v", namespace, name, err)
	}
	return out, metav1.NewControllerRef(out, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))
}

// EnsureNode creates the Node name if it does not exist.
func (cp *ControlPlane) EnsureNode(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelHostname: name}}}
	if _, err := cp.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("kubetest: create Node %s: %v", name, err)
	}
}

// EnsureNamespace creates the namespace name if it does not exist.
func (cp *ControlPlane) EnsureNamespace(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if _, err := cp.client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("kubetest: create Namespace %s: %v", name, err)
	}
}

// EndpointSlices lists the EndpointSlices of a Service (label
// kubernetes.io/service-name).
func (cp *ControlPlane) EndpointSlices(ctx context.Context, namespace, service string) ([]discoveryv1.EndpointSlice, error) {
	list, err := cp.client.DiscoveryV1().EndpointSlices(namespace).List(ctx,
		metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + service})
	if err != nil {
		return nil, fmt.Errorf("list EndpointSlices of %s/%s: %w", namespace, service, err)
	}
	return list.Items, nil
}

// WaitEndpointSlices polls the EndpointSlices of a Service until cond holds, and
// returns them. It fails the test after WaitTimeout with the last slices seen.
func (cp *ControlPlane) WaitEndpointSlices(t testing.TB, namespace, service string, cond func([]discoveryv1.EndpointSlice) bool) []discoveryv1.EndpointSlice {
	t.Helper()
	var last []discoveryv1.EndpointSlice
	var lastErr error
	if !testenv.WaitFor(WaitTimeout, func() bool {
		ctx, cancel := opContext(t)
		defer cancel()
		last, lastErr = cp.EndpointSlices(ctx, namespace, service)
		return lastErr == nil && cond(last)
	}) {
		t.Fatalf("kubetest: EndpointSlices of %s/%s not as wanted after %v (error: %v); last seen:\n%s",
			namespace, service, WaitTimeout, lastErr, describeSlices(last))
	}
	return last
}

// WaitReadyEndpoints waits until the Service's EndpointSlices hold exactly n ready
// endpoints and returns the slices. A dual-stack Service has one slice per family,
// so each dual-stack Pod counts once per family.
func (cp *ControlPlane) WaitReadyEndpoints(t testing.TB, namespace, service string, n int) []discoveryv1.EndpointSlice {
	t.Helper()
	return cp.WaitEndpointSlices(t, namespace, service, func(s []discoveryv1.EndpointSlice) bool {
		return len(s) > 0 && ReadyEndpoints(s) == n
	})
}

// ReadyEndpoints counts the endpoints whose ready condition is true.
func ReadyEndpoints(slices []discoveryv1.EndpointSlice) int {
	n := 0
	for _, s := range slices {
		for _, ep := range s.Endpoints {
			if ep.Conditions.Ready != nil && *ep.Conditions.Ready {
				n++
			}
		}
	}
	return n
}

func describeSlices(slices []discoveryv1.EndpointSlice) string {
	if len(slices) == 0 {
		return "  (none)"
	}
	var out string
	for _, s := range slices {
		out += fmt.Sprintf("  %s (%s):\n", s.Name, s.AddressType)
		for _, ep := range s.Endpoints {
			host := ""
			if ep.Hostname != nil {
				host = " hostname=" + *ep.Hostname
			}
			ready := ep.Conditions.Ready != nil && *ep.Conditions.Ready
			out += fmt.Sprintf("    %v ready=%v%s\n", ep.Addresses, ready, host)
		}
	}
	return out
}
