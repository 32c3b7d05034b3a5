package kubesource

import (
	"net/netip"
	"slices"
	"strings"
	"sync"

	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// PodRef is a Pod of this node: what `meshdns-ebpf stats` needs to name the
// pod a cgroup belongs to (kubelet puts the Pod's UID in its cgroup path).
type PodRef struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Labels select the Pod for egress policies.
	Labels map[string]string `json:"labels,omitempty"`
}

// Pods lists the Pods of this node the source knows, by namespace and
// name: none before Run has started or without Config.NodeName.
func (s *Source) Pods() []PodRef {
	st := s.pods.get()
	if st == nil {
		return nil
	}
	var out []PodRef
	for _, o := range st.List() {
		if p, ok := o.(*pod); ok && p.uid != "" {
			out = append(out, PodRef{UID: p.uid, Namespace: p.Namespace, Name: p.Name, Labels: p.labels})
		}
	}
	slices.SortFunc(out, func(a, b PodRef) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
	return out
}

// PodByUID finds a Pod of this node by UID (a cgroup path carries it): the
// workload index of internal/workload.
func (s *Source) PodByUID(uid string) (workload.Pod, bool) {
	return s.findPod(func(p *pod) bool { return p.uid == uid })
}

// PodByIP finds the Pod of this node that has ip (host-network Pods have
// none of their own).
func (s *Source) PodByIP(ip netip.Addr) (workload.Pod, bool) {
	return s.findPod(func(p *pod) bool { return slices.Contains(p.ips, ip) })
}

func (s *Source) findPod(match func(*pod) bool) (workload.Pod, bool) {
	st := s.pods.get()
	if st == nil {
		return workload.Pod{}, false
	}
	for _, o := range st.List() {
		if p, ok := o.(*pod); ok && match(p) {
			return workload.Pod{Namespace: p.Namespace, Name: p.Name, UID: p.uid, Containers: p.containers}, true
		}
	}
	return workload.Pod{}, false
}

// PodAnnotations returns the meshdns.io/ annotations of this node's Pod
// namespace/name (nil: none, or no such Pod): internal/budgetoverride's
// Objects.
func (s *Source) PodAnnotations(namespace, name string) map[string]string {
	if st := s.pods.get(); st != nil {
		if o, ok, _ := st.GetByKey(namespace + "/" + name); ok {
			if p, ok := o.(*pod); ok {
				return p.ann
			}
		}
	}
	return nil
}

// NamespaceAnnotations returns the meshdns.io/ annotations of Namespace name
// (nil: none, or not known): internal/budgetoverride's Objects.
func (s *Source) NamespaceAnnotations(name string) map[string]string {
	if st := s.namespaces.get(); st != nil {
		if o, ok, _ := st.GetByKey(name); ok {
			if n, ok := o.(*namespace); ok {
				return n.ann
			}
		}
	}
	return nil
}

// podIndex holds an informer's store (the pods', the namespaces') once Run
// made it.
type podIndex struct {
	mu sync.Mutex
	st cache.Store
}

func (p *podIndex) set(st cache.Store) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.st = st
}

func (p *podIndex) get() cache.Store {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.st
}
