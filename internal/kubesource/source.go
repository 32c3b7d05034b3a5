// Package kubesource is the name source of a Kubernetes cluster: client-go
// informers over Services, EndpointSlices and (for the local cluster) the
// Pods of this node, each with a transform that keeps only what DNS needs,
// turned into name table hosts (Kubernetes DNS specification) and client
// namespaces for the name store. Kubernetes code (client-go) lives in this
// package and the other Kubernetes packages (kubeclient, kubelife,
// meshsource, the agent's wiring); the resolver and the table never import
// it. They read the API server through internal/kubeclient, never through
// client-go's clientset (k8s.io/client-go/kubernetes), whose scheme would
// link every built-in API group into the agent.
package kubesource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// Config configures a Kubernetes source.
type Config struct {
	// Name of the source in the store ("kubernetes", "cluster/<name>").
	Name string
	// Rest is the API server connection.
	Rest *rest.Config
	// Domain is the cluster domain ("cluster.local").
	Domain string
	// NodeName, when set, watches the Pods of this node: their IPs become
	// clients of their namespace. Remote clusters leave it empty.
	NodeName string
	Logger   *slog.Logger
}

// Source is a Kubernetes cluster as a name source.
type Source struct {
	cfg    Config
	domain string // with the trailing dot
	log    *slog.Logger
	client *kubeclient.Client
	pods   podIndex
	// namespaces holds the namespace informer's store (with NodeName: the
	// Namespaces' budget annotations for this node's pods)
	namespaces podIndex
	// backends: one Service's endpoint addresses for the datapath (backends.go)
	backends backendWatch
	// podWatchers are told of every change of this node's Pods (OnPods).
	podWatchers struct {
		sync.Mutex
		fs []func()
	}
}

// OnPods registers f, called after every change of this node's Pods (added,
// updated, deleted) from the informer's goroutine: f must not block.
func (s *Source) OnPods(f func()) {
	s.podWatchers.Lock()
	s.podWatchers.fs = append(s.podWatchers.fs, f)
	s.podWatchers.Unlock()
}

// podsChanged tells the OnPods watchers.
func (s *Source) podsChanged() {
	s.podWatchers.Lock()
	fs := s.podWatchers.fs
	s.podWatchers.Unlock()
	for _, f := range fs {
		f()
	}
}

// New validates cfg and creates the client. It contacts nothing.
func New(cfg Config) (*Source, error) {
	if cfg.Name == "" {
		return nil, errors.New("kubernetes source: no name")
	}
	if cfg.Rest == nil {
		return nil, errors.New("kubernetes source: no API server configuration")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	domain := strings.ToLower(strings.Trim(cfg.Domain, "."))
	if domain == "" {
		domain = nametable.DefaultClusterDomain
	}
	rc := rest.CopyConfig(cfg.Rest)
	// Protobuf: less CPU and memory than JSON for the built-in types.
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	rc.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	if rc.UserAgent == "" {
		rc.UserAgent = "meshdns-ebpf"
	}
	kc, err := kubeclient.New(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes source %s: %w", cfg.Name, err)
	}
	return &Source{cfg: cfg, domain: domain + ".", log: cfg.Logger.With("source", cfg.Name), client: kc}, nil
}

// Name implements names.Source.
func (s *Source) Name() string { return s.cfg.Name }

// Run implements names.Source: it runs the informers, delivers every
// change to sink, marks the source synced once every informer has listed,
// and reports the API server's reachability through sink.Failed.
func (s *Source) Run(ctx context.Context, sink names.Sink) error {
	h := NewHealth(sink, s.log)
	svcInf := s.informer(h, "services", &corev1.Service{}, transformService,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return s.client.Services("").List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return s.client.Services("").Watch(ctx, o)
		}, nil)
	sliceInf := s.informer(h, "endpointslices", &discoveryv1.EndpointSlice{}, transformSlice,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return s.client.EndpointSlices("").List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return s.client.EndpointSlices("").Watch(ctx, o)
		}, nil)
	informers := []cache.SharedIndexInformer{svcInf, sliceInf}
	svcs := newServices(s.domain, svcInf.GetStore(), sink, s.log)
	var regs []cache.ResourceEventHandlerRegistration
	reg, err := svcInf.AddEventHandler(svcs.serviceHandler())
	if err != nil {
		return err
	}
	regs = append(regs, reg)
	if reg, err = sliceInf.AddEventHandler(svcs.sliceHandler()); err != nil {
		return err
	}
	regs = append(regs, reg)
	if _, err = sliceInf.AddEventHandler(s.backends.handler()); err != nil {
		return err
	}
	s.backends.setStore(sliceInf.GetStore())

	if s.cfg.NodeName != "" {
		sel := fields.OneTermEqualSelector("spec.nodeName", s.cfg.NodeName).String()
		podInf := s.informer(h, "pods", &corev1.Pod{}, transformPod,
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.FieldSelector = sel
				return s.client.Pods("").List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = sel
				return s.client.Pods("").Watch(ctx, o)
			}, nil)
		setPod := func(obj any, gone bool) {
			p, ok := unwrap(obj).(*pod)
			if !ok {
				return
			}
			var ips []netip.Addr
			if !gone {
				ips = p.ips
			}
			if err := sink.SetClients(p.Key(), ips, p.Namespace); err != nil {
				s.log.Warn("pod not recorded as a client", "pod", p.Key(), "err", err)
			}
		}
		reg, err = podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(obj any) { setPod(obj, false); s.podsChanged() },
			UpdateFunc: func(_, obj any) { setPod(obj, false); s.podsChanged() },
			DeleteFunc: func(obj any) { setPod(obj, true); s.podsChanged() },
		})
		if err != nil {
			return err
		}
		regs = append(regs, reg)
		informers = append(informers, podInf)
		s.pods.set(podInf.GetStore())

		// Namespaces: their meshdns.io/ annotations (upstream budgets of
		// their pods, internal/budgetoverride).
		nsInf := s.informer(h, "namespaces", &corev1.Namespace{}, transformNamespace,
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				return s.client.Namespaces().List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				return s.client.Namespaces().Watch(ctx, o)
			}, nil)
		if reg, err = nsInf.AddEventHandler(cache.ResourceEventHandlerFuncs{}); err != nil {
			return err
		}
		regs = append(regs, reg)
		informers = append(informers, nsInf)
		s.namespaces.set(nsInf.GetStore())
	}

	var wg sync.WaitGroup
	for _, inf := range informers {
		wg.Go(func() { inf.RunWithContext(ctx) })
	}
	wg.Go(func() { svcs.run(ctx) })
	defer wg.Wait()
	// Synced once every handler has been given what the initial lists held,
	// the hosts of every Service they queued are delivered, and the store's
	// count of them agrees with the informer's.
	synced := make([]cache.InformerSynced, len(regs))
	for i, r := range regs {
		synced[i] = r.HasSynced
	}
	start := time.Now()
	if !cache.WaitForCacheSync(ctx.Done(), synced...) || !svcs.settle(ctx) {
		return nil // stopped before the first sync
	}
	sink.Synced()
	s.log.Info("kubernetes source synced", "after", time.Since(start).Round(time.Millisecond),
		"services", len(svcInf.GetStore().ListKeys()), "endpointslices", len(sliceInf.GetStore().ListKeys()))
	<-ctx.Done()
	return nil
}

// informer makes a shared index informer whose transform keeps only what
// DNS needs and whose list and watch report the API server's health.
func (s *Source) informer(h *Health, what string, example runtime.Object, transform cache.TransformFunc,
	list ListFunc, watchFn WatchFunc, indexers cache.Indexers) cache.SharedIndexInformer {
	return h.Informer(s.cfg.Name+" "+what, what, example, transform, list, watchFn, indexers)
}

func unwrap(obj any) any {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return t.Obj
	}
	return obj
}

func keyOf(obj any) string {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		return t.Key
	}
	k, _ := cache.MetaNamespaceKeyFunc(obj)
	return k
}

// ClusterDNS returns the cluster IPs of the cluster DNS Service ns/name
// (kube-system/kube-dns: what pods have in their resolv.conf).
func ClusterDNS(ctx context.Context, rc *rest.Config, service string) ([]netip.Addr, error) {
	ns, name, ok := strings.Cut(service, "/")
	if !ok || ns == "" || name == "" {
		return nil, fmt.Errorf("cluster DNS service %q: want namespace/name", service)
	}
	kc, err := kubeclient.New(rc)
	if err != nil {
		return nil, err
	}
	svc, err := kc.Services(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("find the cluster DNS Service %s: %w", service, err)
	}
	ips := svc.Spec.ClusterIPs
	if len(ips) == 0 && svc.Spec.ClusterIP != "" {
		ips = []string{svc.Spec.ClusterIP}
	}
	addrs := parseAddrs(ips...)
	if len(addrs) == 0 {
		return nil, fmt.Errorf("the cluster DNS Service %s has no cluster IP", service)
	}
	return addrs, nil
}
