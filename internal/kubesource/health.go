package kubesource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// ListFunc and WatchFunc list and watch one resource for an informer.
type (
	ListFunc  func(context.Context, metav1.ListOptions) (runtime.Object, error)
	WatchFunc func(context.Context, metav1.ListOptions) (watch.Interface, error)
)

// Health tracks whether the API server answers the informers' lists and
// watches of one source, and reports it through the source's sink
// (names.Sink.Failed). While it does not, the calls are retried here, every
// 100 ms growing to 500 ms, instead of failing into the reflector's own
// backoff (800 ms doubling to 30 s): a restarted API server is seen again
// within about half a second, and the last state keeps serving meanwhile.
// That includes refusals (403 right after an API server restart, before its
// RBAC caches fill; or a ClusterRole that lacks a rule, fixed later): they
// are reported at once and retried, so a fixed role takes effect at once.
//
// Other name sources that watch the API server (ServiceEntries, remote
// clusters' secrets) use it for their informers too.
type Health struct {
	sink    names.Sink
	log     *slog.Logger
	mu      sync.Mutex
	failing map[string]error
}

// NewHealth reports the health of a source's informers to sink.
func NewHealth(sink names.Sink, log *slog.Logger) *Health {
	return &Health{sink: sink, log: log, failing: map[string]error{}}
}

// Informer makes a shared index informer (desc names it in client-go's
// logs) whose transform keeps only what DNS needs and whose list and watch
// of the resource what are retried and reported here.
func (h *Health) Informer(desc, what string, example runtime.Object, transform cache.TransformFunc,
	list ListFunc, watchFn WatchFunc, indexers cache.Indexers) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			var out runtime.Object
			err := h.call(ctx, what, func() (err error) { out, err = list(ctx, o); return err })
			return out, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			var out watch.Interface
			err := h.call(ctx, what, func() (err error) { out, err = watchFn(ctx, o); return err })
			return out, err
		},
	}
	if indexers == nil {
		indexers = cache.Indexers{}
	}
	inf := cache.NewSharedIndexInformerWithOptions(lw, example, cache.SharedIndexInformerOptions{
		Indexers:          indexers,
		ObjectDescription: desc,
	})
	_ = inf.SetTransform(transform)
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if !errors.Is(err, context.Canceled) {
			h.report(what, err)
		}
	})
	return inf
}

// Clear forgets the failures of resource what: its informer was stopped on
// purpose.
func (h *Health) Clear(what string) { h.report(what, nil) }

// Report records that what fails (err) or works again (nil), for origins
// other than an informer's list and watch (a directory of kubeconfigs).
func (h *Health) Report(what string, err error) { h.report(what, err) }

func (h *Health) call(ctx context.Context, what string, fn func() error) error {
	delay := 100 * time.Millisecond
	for {
		err := fn()
		if err == nil {
			h.report(what, nil)
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		h.report(what, err)
		if !retriable(err) {
			return err
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
		delay = min(2*delay, 500*time.Millisecond)
	}
}

// retriable reports whether the call should be retried here; a resource
// version that is too old is the reflector's to handle (it lists anew).
func retriable(err error) bool {
	return !apierrors.IsGone(err) && !apierrors.IsResourceExpired(err)
}

func (h *Health) report(what string, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err == nil {
		if _, was := h.failing[what]; !was {
			return
		}
		delete(h.failing, what)
	} else {
		if apierrors.IsForbidden(err) {
			err = fmt.Errorf("%s: %w (the agent's ClusterRole must allow get, list and watch on %s)", what, err, what)
		} else {
			err = fmt.Errorf("%s: %w", what, err)
		}
		if prev, was := h.failing[what]; !was || prev.Error() != err.Error() {
			h.log.Warn("kubernetes API call failing", "resource", what, "err", err)
		}
		h.failing[what] = err
	}
	for _, e := range h.failing {
		h.sink.Failed(e)
		return
	}
	h.sink.Failed(nil)
}
