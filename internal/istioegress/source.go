package istioegress

import (
	"context"
	"encoding/json"
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
	"sigs.k8s.io/yaml"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
	"github.com/meshdns/meshdns-ebpf/internal/meshsource"
)

// MeshConfigMap is the ConfigMap of the mesh config in the root namespace,
// and MeshConfigKey its key.
const (
	MeshConfigMap = "istio"
	MeshConfigKey = "mesh"
)

var (
	configMapGVR = schema.GroupVersionResource{Version: "v1", Resource: "configmaps"}
	sidecarGVR   = schema.GroupVersionResource{Group: "networking.istio.io", Version: "v1", Resource: "sidecars"}
)

// EntrySource is where the ServiceEntries come from: the name source of
// ServiceEntries (meshsource.ServiceEntries), so that they are watched
// once.
type EntrySource interface {
	// Entries are the ServiceEntries now, and whether that is all.
	Entries() ([]meshsource.Entry, bool)
	// Subscribe registers a function called after every change.
	Subscribe(func())
}

// Options configure a Source.
type Options struct {
	// ServiceEntries is required: the running ServiceEntry name source.
	ServiceEntries EntrySource
	// OnChange is called with every new Set (calls do not overlap).
	OnChange      func(*egresspolicy.Set)
	RootNamespace string                // default istio-system
	Domain        string                // cluster domain, default cluster.local
	FailMode      egresspolicy.FailMode // default fail-open
	Logger        *slog.Logger
}

// Source watches the mesh config and the Sidecars, reads the ServiceEntries
// of the ServiceEntry name source, and publishes the REGISTRY_ONLY policies
// (Compute) whenever any of them changes. It publishes first once all are
// listed; while the Sidecar CRD is not installed it publishes nothing and
// its informer retries.
type Source struct {
	dc     dynamic.Interface
	opts   Options
	log    *slog.Logger
	cancel context.CancelFunc
	done   chan struct{}
	kick   chan struct{}

	mu   sync.Mutex
	set  *egresspolicy.Set
	last []byte // the policies last published, to publish only changes
}

// New creates the source for the API server of rc. It contacts nothing.
func New(rc *rest.Config, opts Options) (*Source, error) {
	if rc == nil {
		return nil, errors.New("istio registry-only source: no API server configuration")
	}
	if opts.ServiceEntries == nil {
		return nil, errors.New("istio registry-only source: no ServiceEntry source (REGISTRY_ONLY needs the ServiceEntries)")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.RootNamespace == "" {
		opts.RootNamespace = "istio-system"
	}
	rc = rest.CopyConfig(rc)
	if rc.UserAgent == "" {
		rc.UserAgent = "meshdns-ebpf"
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("istio registry-only source: %w", err)
	}
	return &Source{dc: dc, opts: opts, log: opts.Logger.With("source", SourceName), kick: make(chan struct{}, 1)}, nil
}

// Set is the last published Set (nil before the first).
func (s *Source) Set() *egresspolicy.Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.set
}

type lister interface {
	List(ctx context.Context, o metav1.ListOptions) (*unstructured.UnstructuredList, error)
	Watch(ctx context.Context, o metav1.ListOptions) (watch.Interface, error)
}

func (s *Source) informer(what string, res lister, fieldSel string, transform cache.TransformFunc) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = fieldSel
			return res.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = fieldSel
			return res.Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformerWithOptions(lw, &unstructured.Unstructured{},
		cache.SharedIndexInformerOptions{ObjectDescription: what})
	_ = inf.SetTransform(transform)
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if !errors.Is(err, context.Canceled) {
			s.log.Warn("cannot list or watch "+what+", the policies in force stay", "err", err)
		}
	})
	return inf
}

// Start watches until Close or ctx ends.
func (s *Source) Start(ctx context.Context) error {
	if s.done != nil {
		return errors.New("istio registry-only source: started twice")
	}
	ctx, s.cancel = context.WithCancel(ctx)
	mesh := s.informer("the mesh config", s.dc.Resource(configMapGVR).Namespace(s.opts.RootNamespace),
		fields.OneTermEqualSelector("metadata.name", MeshConfigMap).String(), transformMesh)
	sidecars := s.informer("sidecars", s.dc.Resource(sidecarGVR).Namespace(metav1.NamespaceAll), "", transformSidecar)
	poke := func() {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
	s.opts.ServiceEntries.Subscribe(poke)
	var synced []cache.InformerSynced
	for _, inf := range []cache.SharedIndexInformer{mesh, sidecars} {
		reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: func(any) { poke() }, UpdateFunc: func(any, any) { poke() }, DeleteFunc: func(any) { poke() },
		})
		if err != nil {
			return fmt.Errorf("istio registry-only source: %w", err)
		}
		synced = append(synced, reg.HasSynced)
	}
	s.done = make(chan struct{})
	var wg sync.WaitGroup
	for _, inf := range []cache.SharedIndexInformer{mesh, sidecars} {
		wg.Add(1)
		go func() { defer wg.Done(); inf.RunWithContext(ctx) }()
	}
	go func() {
		defer close(s.done)
		defer wg.Wait()
		if !cache.WaitForCacheSync(ctx.Done(), synced...) {
			return
		}
		for {
			s.publish(mesh, sidecars)
			select {
			case <-ctx.Done():
				return
			case <-s.kick:
			}
		}
	}()
	return nil
}

// Close stops watching and waits.
func (s *Source) Close() error {
	if s.cancel != nil {
		s.cancel()
		<-s.done
	}
	return nil
}

// publish computes the policies from the informers' state and publishes
// them when they changed.
func (s *Source) publish(mesh, sidecars cache.SharedIndexInformer) {
	entries, complete := s.opts.ServiceEntries.Entries()
	if !complete {
		return // published when they are: Subscribe kicks
	}
	in := Inputs{RootNamespace: s.opts.RootNamespace, Domain: s.opts.Domain, FailMode: s.opts.FailMode}
	for _, o := range mesh.GetStore().List() {
		if m, ok := o.(*meshConfig); ok {
			if m.err != nil {
				s.log.Warn("the mesh config does not parse, its outbound traffic policy is taken as ALLOW_ANY", "err", m.err)
			}
			in.MeshMode = m.mode
		}
	}
	for _, o := range sidecars.GetStore().List() {
		if sc, ok := o.(*sidecar); ok {
			in.Sidecars = append(in.Sidecars, sc.Sidecar)
		}
	}
	for _, e := range entries {
		in.ServiceEntries = append(in.ServiceEntries, ServiceEntry{Namespace: e.Namespace, Name: e.Name, Hosts: e.Hosts, ExportTo: e.ExportTo})
	}
	ps := Compute(in)
	b, _ := json.Marshal(ps)
	s.mu.Lock()
	same := s.set != nil && slices.Equal(b, s.last)
	s.mu.Unlock()
	if same {
		return
	}
	set, err := egresspolicy.NewSet(ps)
	if err != nil { // Compute keeps only valid names: a bug
		s.log.Error("REGISTRY_ONLY policies do not make a set, the previous one stays", "err", err)
		return
	}
	s.mu.Lock()
	s.set, s.last = set, b
	s.mu.Unlock()
	s.log.Info("Istio REGISTRY_ONLY policies published", "policies", set.Len())
	if s.opts.OnChange != nil {
		s.opts.OnChange(set)
	}
}

// The informers keep these compact objects.

type meshConfig struct {
	kubeclient.Meta
	mode string
	err  error
}

func (m *meshConfig) DeepCopyObject() runtime.Object { return m }

type sidecar struct {
	kubeclient.Meta
	Sidecar
}

func (s *sidecar) DeepCopyObject() runtime.Object { return s }

func transformMesh(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil
	}
	m := &meshConfig{Meta: kubeclient.Meta{Name: u.GetName(), Namespace: u.GetNamespace()}}
	data, _, _ := unstructured.NestedString(u.Object, "data", MeshConfigKey)
	var mc struct {
		OutboundTrafficPolicy struct {
			Mode string `json:"mode"`
		} `json:"outboundTrafficPolicy"`
	}
	if err := yaml.Unmarshal([]byte(data), &mc); err != nil {
		m.err = fmt.Errorf("%s/%s %s: %w", u.GetNamespace(), u.GetName(), MeshConfigKey, err)
	} else {
		m.mode = mc.OutboundTrafficPolicy.Mode
	}
	return m, nil
}

func transformSidecar(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil
	}
	_, sel, _ := unstructured.NestedFieldNoCopy(u.Object, "spec", "workloadSelector")
	mode, _, _ := unstructured.NestedString(u.Object, "spec", "outboundTrafficPolicy", "mode")
	return &sidecar{Meta: kubeclient.Meta{Name: u.GetName(), Namespace: u.GetNamespace()},
		Sidecar: Sidecar{Namespace: u.GetNamespace(), Name: u.GetName(), Selector: sel, Mode: mode,
			Created: u.GetCreationTimestamp().UTC().Format("2006-01-02T15:04:05Z")}}, nil
}
