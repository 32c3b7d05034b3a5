package kubesource

import (
	"slices"
	"strings"
	"sync"

	"k8s.io/client-go/tools/cache"
)

// PodRef is a Pod of this node: what `meshdns-ebpf stats` needs to name the
// pod a cgroup belongs to (kubelet puts the Pod's UID in its cgroup path).
type PodRef struct {
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
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
			out = append(out, PodRef{UID: p.uid, Namespace: p.namespace, Name: p.name})
		}
	}
	slices.SortFunc(out, func(a, b PodRef) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
	return out
}

// podIndex holds the pod informer's store once Run made it.
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
