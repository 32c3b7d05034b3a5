package meshsource

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// ClusterPrefix starts the store name of every remote cluster's source:
// "cluster/<name>".
const ClusterPrefix = "cluster/"

// clusterSource is one remote cluster: a Kubernetes source (Services and
// EndpointSlices, no Pods) whose kubeconfig may change while it runs. A new
// kubeconfig restarts the watches as a new generation: the names of the
// old one keep serving until the new one has synced, and then what it did
// not see is removed. A kubeconfig that cannot be parsed keeps the old
// watches running and is reported.
type clusterSource struct {
	name   string // "cluster/<name>"
	domain string
	base   *slog.Logger // for the Kubernetes source, which adds the source name
	log    *slog.Logger

	mu      sync.Mutex
	config  []byte
	changed chan struct{}
}

func newClusterSource(cluster, domain string, log *slog.Logger) *clusterSource {
	name := ClusterPrefix + cluster
	return &clusterSource{name: name, domain: domain, base: log, log: log.With("source", name), changed: make(chan struct{}, 1)}
}

// Name implements names.Source.
func (c *clusterSource) Name() string { return c.name }

// update hands the source its (new) kubeconfig.
func (c *clusterSource) update(kubeconfig []byte) {
	c.mu.Lock()
	c.config = kubeconfig
	c.mu.Unlock()
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

// Run implements names.Source.
func (c *clusterSource) Run(ctx context.Context, sink names.Sink) error {
	sw := newSweeper(sink)
	var inner *innerRun
	defer func() { inner.stop() }()
	var applied []byte
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-c.changed:
		}
		c.mu.Lock()
		kc := c.config
		c.mu.Unlock()
		if applied != nil && bytes.Equal(kc, applied) {
			continue
		}
		applied = kc
		ks, err := c.newKube(kc)
		if err != nil {
			if inner != nil {
				err = fmt.Errorf("%w; still watching with the previous kubeconfig", err)
			}
			c.log.Error("remote cluster kubeconfig not usable", "err", err)
			sink.Failed(err)
			continue
		}
		restart := inner != nil
		inner.stop()
		sink.Failed(nil) // the new watches report their own health
		inner = startInner(ctx, ks, sw.next())
		if restart {
			c.log.Info("remote cluster kubeconfig changed: watching again, the last state serves until synced")
		}
	}
}

func (c *clusterSource) newKube(kubeconfig []byte) (*kubesource.Source, error) {
	rc, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	// Remote clusters: no Pods (their clients are not on this node).
	return kubesource.New(kubesource.Config{Name: c.name, Rest: rc, Domain: c.domain, Logger: c.base})
}

// innerRun is one generation's Kubernetes source.
type innerRun struct {
	cancel context.CancelFunc
	done   chan struct{}
}

func startInner(ctx context.Context, ks *kubesource.Source, gen names.Sink) *innerRun {
	ctx, cancel := context.WithCancel(ctx)
	r := &innerRun{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		if err := ks.Run(ctx, gen); err != nil && ctx.Err() == nil {
			gen.Failed(err)
		}
	}()
	return r
}

func (r *innerRun) stop() {
	if r == nil {
		return
	}
	r.cancel()
	<-r.done
}
