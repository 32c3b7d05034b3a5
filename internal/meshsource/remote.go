package meshsource

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// RemoteClustersName is the name, in the store, of the source that finds
// the remote clusters. It contributes no names itself; its status says
// whether the directory and the secrets could be read.
const RemoteClustersName = "remote-clusters"

// IstioMultiClusterLabel marks Istio's remote secrets (istioctl
// create-remote-secret): each data key is a cluster name, its value that
// cluster's kubeconfig.
const IstioMultiClusterLabel = "istio/multiCluster"

// maxKubeconfig bounds a kubeconfig file.
const maxKubeconfig = 1 << 20

// SourceSet is what Clusters feeds: one source per remote cluster, added
// when the cluster appears and removed (with its names) when it goes. The
// agent passes its name store.
type SourceSet interface {
	Add(src names.Source, opts names.SourceOptions) error
	Remove(name string)
}

// ClustersConfig configures the remote cluster discovery.
type ClustersConfig struct {
	// Sources gets one source per remote cluster ("cluster/<name>",
	// PriorityRemoteCluster, never blocking readiness).
	Sources SourceSet
	// Dir holds one kubeconfig file per remote cluster, named after the
	// cluster (--remote-kubeconfigs). Files starting with "." are skipped
	// (a mounted Secret's ..data). "" for none.
	Dir string
	// Secrets, when set, is the local API server whose Secrets labelled
	// istio/multiCluster=true in Namespace are Istio remote secrets
	// (--istio-remote-secrets).
	Secrets   *rest.Config
	Namespace string
	// Domain is the cluster domain (every cluster of a mesh shares it).
	Domain string
	// Poll is how often Dir is read besides its inotify events (default
	// 1 s).
	Poll   time.Duration
	Logger *slog.Logger
}

// Clusters finds the remote clusters of the mesh and keeps one Kubernetes
// source in the store per cluster: added when its kubeconfig appears,
// restarted when it changes, removed (with its names) when it goes. A
// kubeconfig file that is also a remote secret's key is taken from the
// file.
type Clusters struct {
	cfg    ClustersConfig
	client *kubeclient.Client // for the secrets; nil without
	log    *slog.Logger
}

// NewClusters validates cfg. It contacts nothing.
func NewClusters(cfg ClustersConfig) (*Clusters, error) {
	if cfg.Sources == nil {
		return nil, errors.New("remote clusters: no source set to feed")
	}
	if cfg.Dir == "" && cfg.Secrets == nil {
		return nil, errors.New("remote clusters: neither a kubeconfig directory nor Istio remote secrets")
	}
	if cfg.Poll <= 0 {
		cfg.Poll = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m := &Clusters{cfg: cfg, log: cfg.Logger.With("source", RemoteClustersName)}
	if cfg.Secrets != nil {
		if cfg.Namespace == "" {
			return nil, errors.New("remote clusters: Istio remote secrets need the agent's namespace")
		}
		rc := rest.CopyConfig(cfg.Secrets)
		rc.ContentType = "application/vnd.kubernetes.protobuf"
		rc.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
		kc, err := kubeclient.New(rc)
		if err != nil {
			return nil, fmt.Errorf("remote clusters: %w", err)
		}
		m.client = kc
	}
	return m, nil
}

// Name implements names.Source.
func (m *Clusters) Name() string { return RemoteClustersName }

// Run implements names.Source: it is synced once the directory has been
// read and the secrets listed.
func (m *Clusters) Run(ctx context.Context, sink names.Sink) error {
	h := kubesource.NewHealth(sink, m.log)
	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()

	secretsSynced := func() bool { return true }
	var secretStore cache.Store
	if m.client != nil {
		inf, synced, err := m.watchSecrets(ctx, h, poke, &wg)
		if err != nil {
			return err
		}
		secretStore, secretsSynced = inf.GetStore(), synced
	}
	var tick <-chan time.Time
	if m.cfg.Dir != "" {
		t := time.NewTicker(m.cfg.Poll)
		defer t.Stop()
		tick = t.C
		m.watchDir(ctx, poke, &wg)
	}

	r := &reconciler{m: m, running: map[string]*clusterSource{}, applied: map[string][]byte{}}
	dirWhat := "--remote-kubeconfigs " + m.cfg.Dir
	var files map[string][]byte
	dirRead, synced := m.cfg.Dir == "", false
	for {
		if m.cfg.Dir != "" {
			f, err := scanDir(m.cfg.Dir)
			h.Report(dirWhat, err)
			// A directory that cannot be read keeps the clusters it had
			// (none at first).
			if err == nil || !dirRead {
				files, dirRead = f, true
			}
		}
		if dirRead && secretsSynced() {
			r.apply(files, secretStore)
			if !synced {
				synced = true
				sink.Synced()
				m.log.Info("remote clusters found", "clusters", slices.Sorted(maps.Keys(r.running)))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		case <-tick:
		}
	}
}

// watchSecrets runs the informer of Istio's remote secrets in the agent's
// namespace; every change pokes.
func (m *Clusters) watchSecrets(ctx context.Context, h *kubesource.Health, poke func(), wg *sync.WaitGroup) (cache.SharedIndexInformer, func() bool, error) {
	sel := IstioMultiClusterLabel + "=true"
	secrets := m.client.Secrets(m.cfg.Namespace)
	inf := h.Informer(RemoteClustersName+" secrets", "secrets", &corev1.Secret{}, transformSecret,
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = sel
			return secrets.List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = sel
			return secrets.Watch(ctx, o)
		}, nil)
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	})
	if err != nil {
		return nil, nil, err
	}
	wg.Add(2)
	go func() { defer wg.Done(); inf.RunWithContext(ctx) }()
	go func() {
		defer wg.Done()
		if cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
			poke() // an empty list calls no handler
		}
	}()
	return inf, reg.HasSynced, nil
}

// watchDir pokes on every inotify event of the directory (a file written,
// a Secret's ..data symlink swapped). The poll catches what inotify
// misses (the directory replaced, or not there yet).
func (m *Clusters) watchDir(ctx context.Context, poke func(), wg *sync.WaitGroup) {
	w, err := fsnotify.NewWatcher()
	if err == nil {
		err = w.Add(m.cfg.Dir)
	}
	if err != nil {
		m.log.Warn("no inotify on the remote kubeconfig directory: reading it every poll only", "dir", m.cfg.Dir, "poll", m.cfg.Poll, "err", err)
		if w != nil {
			w.Close()
		}
		return
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer w.Close()
		for {
			select {
			case <-ctx.Done():
				return
			case _, ok := <-w.Events:
				if !ok {
					return
				}
				poke()
			case _, ok := <-w.Errors:
				if !ok {
					return
				}
				poke()
			}
		}
	}()
}

// reconciler keeps the store's cluster sources in step with the
// kubeconfigs found.
type reconciler struct {
	m       *Clusters
	running map[string]*clusterSource // cluster -> its source
	applied map[string][]byte         // cluster -> kubeconfig handed to it
	dups    string                    // last duplicate report
}

func (r *reconciler) apply(files map[string][]byte, secretStore cache.Store) {
	m := r.m
	want := map[string][]byte{}
	from := map[string]string{}
	for name, kc := range files {
		want[name], from[name] = kc, "file "+filepath.Join(m.cfg.Dir, name)
	}
	var dups []string
	if secretStore != nil {
		objs := secretStore.List()
		slices.SortFunc(objs, func(a, b any) int {
			return strings.Compare(a.(*secret).Name, b.(*secret).Name)
		})
		for _, o := range objs {
			s := o.(*secret)
			for _, name := range slices.Sorted(maps.Keys(s.data)) {
				origin := "secret " + s.Namespace + "/" + s.Name
				if prev, dup := from[name]; dup {
					dups = append(dups, fmt.Sprintf("cluster %s in %s and %s: using %s", name, prev, origin, prev))
					continue
				}
				want[name], from[name] = s.data[name], origin
			}
		}
	}
	if d := strings.Join(dups, "; "); d != r.dups {
		r.dups = d
		if d != "" {
			m.log.Warn("remote cluster given twice", "clusters", d)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		kc := want[name]
		cs := r.running[name]
		if cs == nil {
			cs = newClusterSource(name, m.cfg.Domain, m.cfg.Logger)
			if err := m.cfg.Sources.Add(cs, names.SourceOptions{Priority: names.PriorityRemoteCluster, NonBlocking: true}); err != nil {
				m.log.Error("remote cluster not added", "cluster", name, "err", err)
				continue
			}
			r.running[name] = cs
			m.log.Info("remote cluster added", "cluster", name, "from", from[name])
		}
		if prev, ok := r.applied[name]; !ok || !bytes.Equal(prev, kc) {
			r.applied[name] = kc
			cs.update(kc)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(r.running)) {
		if _, ok := want[name]; ok {
			continue
		}
		m.cfg.Sources.Remove(r.running[name].Name())
		delete(r.running, name)
		delete(r.applied, name)
		m.log.Info("remote cluster removed, with its names", "cluster", name)
	}
}

// scanDir reads every kubeconfig of dir: regular files (or symlinks to
// them), not starting with ".". On any error the caller keeps what it had.
func scanDir(dir string) (map[string][]byte, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".") {
			continue
		}
		p := filepath.Join(dir, name)
		fi, err := os.Stat(p)
		if errors.Is(err, os.ErrNotExist) {
			continue // a dangling symlink: a Secret's key being removed
		}
		if err != nil {
			return nil, err
		}
		if !fi.Mode().IsRegular() {
			continue
		}
		if fi.Size() > maxKubeconfig {
			return nil, fmt.Errorf("%s: %d bytes is too large for a kubeconfig", p, fi.Size())
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		out[name] = b
	}
	return out, nil
}

// transformSecret keeps the data of a remote secret.
func transformSecret(obj any) (any, error) {
	s, ok := obj.(*corev1.Secret)
	if !ok {
		return obj, nil
	}
	return &secret{Meta: kubeclient.Meta{Name: s.Name, Namespace: s.Namespace}, data: s.Data}, nil
}
