// Package meshsource holds the name sources of the mesh beyond the local
// cluster: Istio ServiceEntries (networking.istio.io, watched only while
// their CRD is installed) and remote clusters (kubeconfig files of a
// directory and Istio remote secrets), each remote cluster a Kubernetes
// source of its own. Like kubesource it imports client-go (its dynamic
// client for ServiceEntries, internal/kubeclient for the secrets, never the
// clientset), keeps only what DNS needs of each object (informer
// transforms) and feeds the name store through names.Sink; the resolver and
// the table never import it.
package meshsource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// ServiceEntriesName is the ServiceEntry source's name in the store.
const ServiceEntriesName = "serviceentries"

// ServiceEntryCRD is the name of Istio's ServiceEntry CRD.
const ServiceEntryCRD = "serviceentries.networking.istio.io"

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

func serviceEntryGVR(version string) schema.GroupVersionResource {
	return schema.GroupVersionResource{Group: "networking.istio.io", Version: version, Resource: "serviceentries"}
}

// ServiceEntries is the name source of Istio ServiceEntries. It watches the
// ServiceEntry CRD (that one object, by name) and, while it is established,
// the ServiceEntries of every namespace at the newest version the CRD
// serves. Without the CRD it is synced with nothing; when the CRD appears
// it starts watching, when it goes its names go, with no restart.
type ServiceEntries struct {
	dc  dynamic.Interface
	log *slog.Logger

	// What other consumers (the REGISTRY_ONLY egress policies) read of
	// the same watch: Entries and Subscribe.
	mu       sync.Mutex
	cur      *entryWatch // the watch serving, nil without the CRD
	crdKnown bool        // the CRD informer has synced
	curReady bool        // cur has synced (or there is no CRD)
	subs     []func()
}

// Entry is a ServiceEntry as other consumers of the source read it.
type Entry struct {
	Namespace, Name string
	Hosts, ExportTo []string
}

// Subscribe registers f, called after every change of Entries (from the
// source's goroutines; f must not block).
func (s *ServiceEntries) Subscribe(f func()) {
	s.mu.Lock()
	s.subs = append(s.subs, f)
	s.mu.Unlock()
}

// Entries returns the ServiceEntries the source watches now, and whether
// that is all of them: false until the CRD, and the entries when it is
// served, are listed; without the CRD, none and true.
func (s *ServiceEntries) Entries() ([]Entry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil {
		return nil, s.crdKnown
	}
	var out []Entry
	for _, obj := range s.cur.inf.GetStore().List() {
		if se, ok := obj.(*serviceEntry); ok {
			out = append(out, Entry{Namespace: se.Namespace, Name: se.Name, Hosts: se.hosts, ExportTo: se.exportTo})
		}
	}
	return out, s.curReady
}

// state records the watch serving and tells the subscribers.
func (s *ServiceEntries) state(cur *entryWatch, ready bool) {
	s.mu.Lock()
	s.cur, s.crdKnown, s.curReady = cur, true, ready
	s.mu.Unlock()
	s.notify()
}

func (s *ServiceEntries) notify() {
	s.mu.Lock()
	subs := slices.Clone(s.subs)
	s.mu.Unlock()
	for _, f := range subs {
		f()
	}
}

// NewServiceEntries creates the source for the API server of rc. It
// contacts nothing.
func NewServiceEntries(rc *rest.Config, log *slog.Logger) (*ServiceEntries, error) {
	if rc == nil {
		return nil, errors.New("serviceentries source: no API server configuration")
	}
	if log == nil {
		log = slog.Default()
	}
	rc = rest.CopyConfig(rc)
	if rc.UserAgent == "" {
		rc.UserAgent = "meshdns-ebpf"
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("serviceentries source: %w", err)
	}
	return &ServiceEntries{dc: dc, log: log.With("source", ServiceEntriesName)}, nil
}

// Name implements names.Source.
func (s *ServiceEntries) Name() string { return ServiceEntriesName }

// Run implements names.Source.
func (s *ServiceEntries) Run(ctx context.Context, sink names.Sink) error {
	h := kubesource.NewHealth(sink, s.log)
	sw := newSweeper(sink)
	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	sel := fields.OneTermEqualSelector("metadata.name", ServiceEntryCRD).String()
	crds := s.dc.Resource(crdGVR)
	crdInf := h.Informer("serviceentries CRD", "customresourcedefinitions", &unstructured.Unstructured{}, transformCRD,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return crds.List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return crds.Watch(ctx, o)
		}, nil)
	reg, err := crdInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	})
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() { defer wg.Done(); crdInf.RunWithContext(ctx) }()
	if !cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
		return nil
	}

	var cur *entryWatch
	defer func() { cur.stop() }()
	for first := true; ; first = false {
		obj, _, _ := crdInf.GetStore().GetByKey(ServiceEntryCRD)
		c, _ := obj.(*crd)
		switch want := c.version(); {
		case cur == nil && want == "":
			if first {
				sink.Synced() // nothing to watch
				s.state(nil, true)
				s.log.Info("no ServiceEntry CRD served: watching for it", "crd", ServiceEntryCRD)
			}
		case cur == nil || cur.version != want:
			if cur != nil {
				cur.stop()
				h.Clear("serviceentries")
				cur = nil
			}
			gen := sw.next()
			if want == "" {
				gen.Synced() // the CRD is gone: so are its names
				s.state(nil, true)
				s.log.Info("ServiceEntry CRD gone: ServiceEntry names removed", "crd", ServiceEntryCRD)
			} else {
				cur = s.watch(ctx, h, gen, want)
				s.state(cur, false)
				s.log.Info("watching ServiceEntries", "version", want)
			}
		}
		var synced <-chan struct{}
		if cur != nil && !cur.wasSynced {
			synced = cur.synced
		}
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		case <-synced:
			if !cur.settle(ctx) {
				return nil
			}
			cur.wasSynced = true
			cur.gen.Synced()
			s.state(cur, true)
			s.log.Info("ServiceEntries synced", "version", cur.version, "entries", len(cur.inf.GetStore().ListKeys()))
		}
	}
}

// entryWatch is the informer of ServiceEntries at one version.
type entryWatch struct {
	version   string
	gen       names.Sink
	inf       cache.SharedIndexInformer
	cancel    context.CancelFunc
	done      chan struct{}
	synced    chan struct{}
	wasSynced bool
	log       *slog.Logger

	// mu makes each delivery of a key (by the handler, or by an audit's
	// recomputation) one step: read, compute, Set.
	mu       sync.Mutex
	rejected map[string]bool // keys whose hosts the store refused
	// seen counts the entries the handler was told of (adds minus
	// deletes). The informer's store changes before its handler runs:
	// while the two counts differ, an event is on its way. handled is
	// signalled after every event.
	seen    int
	handled chan struct{}
}

// setLocked delivers one ServiceEntry's hosts (none when gone); w.mu is
// held.
func (w *entryWatch) setLocked(obj any, gone bool) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = t.Obj
	}
	se, ok := obj.(*serviceEntry)
	if gone || !ok {
		_ = w.gen.Set(key, nil)
		delete(w.rejected, key)
		return
	}
	hosts, bad := entryHosts(se)
	for _, err := range bad {
		w.log.Warn("ServiceEntry host not answered", "serviceentry", key, "err", err)
	}
	if err := w.gen.Set(key, hosts); err != nil {
		w.log.Warn("ServiceEntry not answered", "serviceentry", key, "err", err)
		w.rejected[key] = true
		return
	}
	delete(w.rejected, key)
}

// settle audits the store's count of ServiceEntries against the
// informer's (names.Sink.Audit) at a moment no event is on its way to the
// handler and, after a mismatch, delivers every ServiceEntry again from
// the informer's state, up to names.MaxAudits times. It returns false when
// ctx ended first.
func (w *entryWatch) settle(ctx context.Context) bool {
	for audits := 0; ; {
		w.mu.Lock()
		want, held := w.expectedLocked()
		if held != w.seen {
			w.mu.Unlock()
			select {
			case <-ctx.Done():
				return false
			case <-w.handled:
			}
			continue
		}
		err := w.gen.Audit(want)
		if err != nil {
			if audits++; audits < names.MaxAudits {
				for _, obj := range w.inf.GetStore().List() {
					w.setLocked(obj, false)
				}
				w.mu.Unlock()
				continue
			}
			w.log.Error("ServiceEntry names still differ from the API server after delivering every entry again", "audits", audits, "err", err)
		}
		w.mu.Unlock()
		return true
	}
}

// expectedLocked counts the ServiceEntries of the informer that have hosts
// and that the store did not refuse (want), and all of them (held); w.mu
// is held.
func (w *entryWatch) expectedLocked() (want, held int) {
	objs := w.inf.GetStore().List()
	for _, obj := range objs {
		se, ok := obj.(*serviceEntry)
		if !ok || w.rejected[se.Namespace+"/"+se.Name] {
			continue
		}
		if hosts, _ := entryHosts(se); len(hosts) > 0 {
			want++
		}
	}
	return want, len(objs)
}

func (s *ServiceEntries) watch(ctx context.Context, h *kubesource.Health, gen names.Sink, version string) *entryWatch {
	ctx, cancel := context.WithCancel(ctx)
	res := s.dc.Resource(serviceEntryGVR(version))
	inf := h.Informer("serviceentries "+version, "serviceentries", &unstructured.Unstructured{}, transformServiceEntry,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return res.Namespace(metav1.NamespaceAll).List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return res.Namespace(metav1.NamespaceAll).Watch(ctx, o)
		}, nil)
	w := &entryWatch{version: version, gen: gen, inf: inf, cancel: cancel, done: make(chan struct{}), synced: make(chan struct{}),
		log: s.log, rejected: map[string]bool{}, handled: make(chan struct{}, 1)}
	set := func(obj any, seen int) {
		w.mu.Lock()
		w.seen += seen
		w.setLocked(obj, seen < 0)
		w.mu.Unlock()
		select {
		case w.handled <- struct{}{}:
		default:
		}
		s.notify()
	}
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { set(obj, 1) },
		UpdateFunc: func(_, obj any) { set(obj, 0) },
		DeleteFunc: func(obj any) { set(obj, -1) },
	})
	if err != nil { // only when the informer already stopped
		gen.Failed(fmt.Errorf("serviceentries: %w", err))
		close(w.done)
		return w
	}
	go func() { defer close(w.done); inf.RunWithContext(ctx) }()
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
			close(w.synced)
		}
	}()
	return w
}

func (w *entryWatch) stop() {
	if w == nil {
		return
	}
	w.cancel()
	<-w.done
}
