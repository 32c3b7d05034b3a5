// Package kubelife tells the agent, when it gets SIGTERM, what Kubernetes is
// doing with it: its DaemonSet or its namespace is being deleted (an
// uninstall: the agent removes everything it put on the node), or a pod of
// its DaemonSet is starting on its node to replace it (kubectl delete pod, an
// eviction: the agent serves on until that pod has taken over), or neither
// (a restart: the programs stay pinned for the next agent). It watches the
// agent's namespace and DaemonSet by name, and the pods of its namespace on
// its node. Watches the API server accepted keep delivering after
// `kubectl delete -k` removed the agent's service account and role, which it
// deletes in the same breath as the DaemonSet and namespace.
package kubelife

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
)

// Config says whose lifecycle to watch.
type Config struct {
	Rest   *rest.Config
	Self   Self   // the agent's pod
	Node   string // the agent's node: a replacement pod is one of its pods
	Logger *slog.Logger
}

// Verdict is what a SIGTERM means.
type Verdict struct {
	// Uninstall: the agent's DaemonSet or namespace is being deleted.
	Uninstall bool
	// Successor is a pod of the agent's DaemonSet on its node, not being
	// deleted, that is not the agent's: it will take over.
	Successor string
	// Reason says why, for the log.
	Reason string
}

// Watch is the running watch of the agent's own objects.
type Watch struct {
	cfg    Config
	log    *slog.Logger
	client *kubeclient.Client

	dsName string // the agent's DaemonSet ("" when its pod has none)
	dsUID  types.UID
	ns     cache.SharedIndexInformer
	ds     cache.SharedIndexInformer
	pods   cache.SharedIndexInformer

	stop context.CancelFunc
	wg   sync.WaitGroup

	mu   sync.Mutex
	errs map[string]error // by resource, while its list or watch fails
}

// New validates cfg and creates the client. It contacts nothing.
func New(cfg Config) (*Watch, error) {
	if cfg.Rest == nil || cfg.Self.Namespace == "" || cfg.Self.Pod == "" {
		return nil, errors.New("kubelife: the API server and the agent's pod are needed")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	rc := rest.CopyConfig(cfg.Rest)
	if rc.UserAgent == "" {
		rc.UserAgent = "meshdns-ebpf"
	}
	kc, err := kubeclient.New(rc)
	if err != nil {
		return nil, fmt.Errorf("kubelife: %w", err)
	}
	return &Watch{cfg: cfg, log: cfg.Logger, client: kc, errs: map[string]error{}}, nil
}

// Start reads the agent's pod (its DaemonSet is its controller) and starts
// the watches; ctx bounds the read. It does not wait for them to sync.
func (w *Watch) Start(ctx context.Context) error {
	self := w.cfg.Self
	pod, err := w.client.Pods(self.Namespace).Get(ctx, self.Pod, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read the agent's pod %s/%s: %w", self.Namespace, self.Pod, err)
	}
	if ref := metav1.GetControllerOf(pod); ref != nil && ref.Kind == "DaemonSet" {
		w.dsName, w.dsUID = ref.Name, ref.UID
	}
	wctx, cancel := context.WithCancel(context.Background())
	w.stop = cancel
	byName := func(name string) func(*metav1.ListOptions) {
		return func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
		}
	}
	core, apps := w.client.CoreV1(), w.client.AppsV1()
	w.ns = w.informer("namespaces", core, "", &corev1.Namespace{}, byName(self.Namespace))
	if w.dsName != "" {
		w.ds = w.informer("daemonsets", apps, self.Namespace, &appsv1.DaemonSet{}, byName(w.dsName))
	}
	if w.cfg.Node != "" {
		w.pods = w.informer("pods", core, self.Namespace, &corev1.Pod{}, func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", w.cfg.Node).String()
		})
	}
	for _, inf := range []cache.SharedIndexInformer{w.ns, w.ds, w.pods} {
		if inf != nil {
			w.wg.Add(1)
			go func() { defer w.wg.Done(); inf.RunWithContext(wctx) }()
		}
	}
	w.log.Info("watching the agent's own objects: a SIGTERM during their deletion uninstalls",
		"pod", self.Namespace+"/"+self.Pod, "daemonset", w.dsName, "node", w.cfg.Node)
	return nil
}

// informer watches resource (in namespace ns, "" for cluster-scoped ones)
// with the list options tweak applies, and reports its failures.
func (w *Watch) informer(resource string, c cache.Getter, ns string, example runtime.Object, tweak func(*metav1.ListOptions)) cache.SharedIndexInformer {
	lw := cache.NewFilteredListWatchFromClient(c, resource, ns, tweak)
	inf := cache.NewSharedIndexInformerWithOptions(lw, example, cache.SharedIndexInformerOptions{ObjectDescription: "kubelife " + resource})
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if !errors.Is(err, context.Canceled) {
			w.report(resource, err)
		}
	})
	return inf
}

// report logs a resource's failure once, until it works again: without its
// watch, a SIGTERM is taken for a restart.
func (w *Watch) report(resource string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if prev, ok := w.errs[resource]; ok && prev.Error() == err.Error() {
		return
	}
	w.errs[resource] = err
	w.log.Warn("cannot watch the agent's own "+resource+": a SIGTERM while they are deleted is taken for a restart (the agent's role must allow get, list and watch of them)",
		"err", err)
}

// Close stops the watches. Idempotent; safe without Start.
func (w *Watch) Close() error {
	if w == nil || w.stop == nil {
		return nil
	}
	w.stop()
	w.wg.Wait()
	return nil
}

// synced reports whether every watch has listed once.
func (w *Watch) synced() bool {
	for _, inf := range []cache.SharedIndexInformer{w.ns, w.ds, w.pods} {
		if inf != nil && !inf.HasSynced() {
			return false
		}
	}
	return true
}

// settleStep is how often Verdict looks again while it waits.
const settleStep = 50 * time.Millisecond

// Verdict says what a SIGTERM received now means. An uninstall or a
// successor is reported as soon as the watches show it; otherwise it waits
// up to settle for them to (the SIGTERM may outrun the watch event that
// explains it) and then reports a restart.
func (w *Watch) Verdict(ctx context.Context, settle time.Duration) Verdict {
	deadline := time.Now().Add(settle)
	for {
		v := w.verdict()
		if v.Uninstall || v.Successor != "" || !time.Now().Before(deadline) {
			return v
		}
		select {
		case <-ctx.Done():
			return v
		case <-time.After(settleStep):
		}
	}
}

func (w *Watch) verdict() Verdict {
	self := w.cfg.Self
	if w.ns != nil && w.ns.HasSynced() {
		obj, ok, _ := w.ns.GetStore().GetByKey(self.Namespace)
		ns, _ := obj.(*corev1.Namespace)
		switch {
		case !ok || ns == nil:
			return Verdict{Uninstall: true, Reason: "namespace " + self.Namespace + " was deleted"}
		case ns.DeletionTimestamp != nil || ns.Status.Phase == corev1.NamespaceTerminating:
			return Verdict{Uninstall: true, Reason: "namespace " + self.Namespace + " is being deleted"}
		}
	}
	if w.ds != nil && w.ds.HasSynced() {
		key := self.Namespace + "/" + w.dsName
		obj, ok, _ := w.ds.GetStore().GetByKey(key)
		ds, _ := obj.(*appsv1.DaemonSet)
		switch {
		case !ok || ds == nil || ds.UID != w.dsUID:
			return Verdict{Uninstall: true, Reason: "daemonset " + key + " was deleted"}
		case ds.DeletionTimestamp != nil:
			return Verdict{Uninstall: true, Reason: "daemonset " + key + " is being deleted"}
		}
	}
	if w.pods != nil && w.dsUID != "" {
		for _, obj := range w.pods.GetStore().List() {
			p, ok := obj.(*corev1.Pod)
			if !ok || p.Name == self.Pod || p.DeletionTimestamp != nil {
				continue
			}
			if ref := metav1.GetControllerOf(p); ref != nil && ref.UID == w.dsUID {
				return Verdict{Successor: p.Name, Reason: "pod " + p.Namespace + "/" + p.Name + " of the same daemonset is starting on this node"}
			}
		}
	}
	return Verdict{Reason: "neither the agent's daemonset nor its namespace is being deleted: a restart"}
}
