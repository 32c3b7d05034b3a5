// Package kubeegress is the Kubernetes source of egress policies: it watches
// the DNSEgressPolicy custom resources (meshdns.io/v1alpha1, namespaced;
// deploy/kubernetes/crds) of every namespace, validates each with
// internal/egresspolicy, publishes the accepted ones as an egresspolicy.Set
// on every change, and writes what it found into each object's status (the
// Accepted condition, observedGeneration) and, for a bad policy, a Warning
// Event.
//
// A bad policy is never applied, not even in part. When an earlier
// generation of the same object was accepted, that generation stays in
// force: the status keeps a copy of the last accepted spec
// (status.acceptedSpec, status.acceptedGeneration), so that every agent,
// also one started after the bad edit, enforces the same thing. A typo in
// an edit neither opens the workloads (fail-open) nor cuts them off.
//
// Every node's agent computes the same status from the same object, and
// writes it only when the object does not already say it (condition status,
// reason, message and observed generation; the transition time is kept), as
// a merge patch conditioned on the object's resourceVersion: a DaemonSet of
// N agents converges after the first write instead of fighting. The Event's
// name is derived from the object, its generation and the message, so N
// agents create it once.
//
// The custom resources are read with client-go's dynamic client (as
// meshsource reads ServiceEntries) and the Events written through
// internal/kubeclient; no clientset, no generated types.
package kubeegress

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
)

// Kind, Group and Version of the custom resource.
const (
	Kind    = "DNSEgressPolicy"
	Group   = "meshdns.io"
	Version = "v1alpha1"
	// CRD is the CustomResourceDefinition's name.
	CRD = "dnsegresspolicies.meshdns.io"
)

// GVR is the resource of DNSEgressPolicies.
var GVR = schema.GroupVersionResource{Group: Group, Version: Version, Resource: "dnsegresspolicies"}

// Condition type and reasons of the status.
const (
	ConditionAccepted = "Accepted"
	ReasonAccepted    = "Accepted"
	ReasonInvalid     = "Invalid"
)

// fieldManager names the agent's status writes.
const fieldManager = "meshdns-ebpf"

// Spec is the custom resource's spec.
type Spec struct {
	PodSelector     egresspolicy.Selector `json:"podSelector,omitempty"`
	Egress          []egresspolicy.Rule   `json:"egress"`
	Mode            egresspolicy.Mode     `json:"mode,omitempty"`
	FailMode        egresspolicy.FailMode `json:"failMode,omitempty"`
	ClusterInternal bool                  `json:"clusterInternal,omitempty"`
}

// Policy converts a spec of the object namespace/name into a policy and
// validates it; the error is egresspolicy.Problems with "spec." paths.
func (s Spec) Policy(namespace, name string) (egresspolicy.Policy, error) {
	p := egresspolicy.Policy{Source: Kind, Name: namespace + "/" + name, Namespace: namespace,
		PodSelector: s.PodSelector, Egress: s.Egress, Mode: s.Mode, FailMode: s.FailMode, ClusterInternal: s.ClusterInternal}
	p.Default()
	if err := p.Validate(); err != nil {
		var ps egresspolicy.Problems
		if errors.As(err, &ps) {
			return p, ps.Prefixed("spec.")
		}
		return p, err
	}
	return p, nil
}

// Options configure a Source.
type Options struct {
	// OnChange is called with every new Set of accepted policies (from
	// one goroutine; calls do not overlap).
	OnChange func(*egresspolicy.Set)
	// WriteStatus makes the source write status and Events (the agent's
	// RBAC allows it); without it the source only reads.
	WriteStatus bool
	// Node names the writer in its Events (reportingInstance).
	Node   string
	Logger *slog.Logger
	// Registerer gets the source's metrics (none when nil).
	Registerer prometheus.Registerer
}

// Source watches DNSEgressPolicies. It publishes its first Set once it
// has listed them all; while the CRD is not installed, or the agent may
// not list them, it publishes nothing, logs why and keeps retrying (the
// informer's backoff).
type Source struct {
	dc     dynamic.Interface
	kc     *kubeclient.Client
	opts   Options
	log    *slog.Logger
	inf    cache.SharedIndexInformer
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	pending map[string]bool
	kick    chan struct{}
	set     *egresspolicy.Set

	// The worker's: the policy in force of each object, the objects
	// not accepted, and the Events to create again after a failure.
	inForce  map[string]egresspolicy.Policy
	rejected map[string]bool
	eventDue map[string]bool

	writes   *prometheus.CounterVec
	policies *prometheus.GaugeVec
}

// New creates the source for the API server of rc. It contacts nothing.
func New(rc *rest.Config, opts Options) (*Source, error) {
	if rc == nil {
		return nil, errors.New("dnsegresspolicies source: no API server configuration")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	rc = rest.CopyConfig(rc)
	if rc.UserAgent == "" {
		rc.UserAgent = "meshdns-ebpf"
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("dnsegresspolicies source: %w", err)
	}
	kc, err := kubeclient.New(rc)
	if err != nil {
		return nil, fmt.Errorf("dnsegresspolicies source: %w", err)
	}
	s := &Source{dc: dc, kc: kc, opts: opts, log: opts.Logger.With("source", "dnsegresspolicies"),
		pending: map[string]bool{}, kick: make(chan struct{}, 1), inForce: map[string]egresspolicy.Policy{},
		rejected: map[string]bool{}, eventDue: map[string]bool{},
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "meshdns_egress_policy_status_writes_total",
			Help: "DNSEgressPolicy status patches and Events this agent sent (kind: status, event); each node's agent skips what is already written."},
			[]string{"kind"}),
		policies: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "meshdns_egress_policies",
			Help: "DNSEgressPolicies by what the agent found (accepted; rejected: not accepted, an earlier generation may stay in force)."},
			[]string{"state"}),
	}
	for _, kind := range []string{"status", "event"} {
		s.writes.WithLabelValues(kind)
	}
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{s.writes, s.policies} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("register DNSEgressPolicy metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Set is the last published Set (nil before the first).
func (s *Source) Set() *egresspolicy.Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.set
}

// Start watches until Close or ctx ends. The first Set is published once
// the informer has listed every policy.
func (s *Source) Start(ctx context.Context) error {
	if s.done != nil {
		return errors.New("dnsegresspolicies source: started twice")
	}
	ctx, s.cancel = context.WithCancel(ctx)
	res := s.dc.Resource(GVR).Namespace(metav1.NamespaceAll)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return res.List(ctx, o) },
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return res.Watch(ctx, o)
		},
	}
	s.inf = cache.NewSharedIndexInformerWithOptions(lw, &unstructured.Unstructured{},
		cache.SharedIndexInformerOptions{ObjectDescription: "dnsegresspolicies"})
	_ = s.inf.SetTransform(transform)
	_ = s.inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if !errors.Is(err, context.Canceled) {
			s.log.Warn("cannot list or watch DNSEgressPolicies, the policies in force stay", "err", err)
		}
	})
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			s.enqueue(key)
		}
	}
	reg, err := s.inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, o any) { enqueue(o) }, DeleteFunc: enqueue,
	})
	if err != nil {
		return fmt.Errorf("dnsegresspolicies source: %w", err)
	}
	s.done = make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); s.inf.RunWithContext(ctx) }()
	go func() {
		defer close(s.done)
		defer wg.Wait()
		if !cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
			return
		}
		s.work(ctx, true)
		for {
			select {
			case <-ctx.Done():
				return
			case <-s.kick:
				s.work(ctx, false)
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

// work handles the keys pending and publishes the Set when what is in
// force changed (or first).
func (s *Source) work(ctx context.Context, first bool) {
	s.mu.Lock()
	keys := slices.Sorted(maps.Keys(s.pending))
	clear(s.pending)
	s.mu.Unlock()
	changed := first
	for _, key := range keys {
		if s.sync(ctx, key) {
			changed = true
		}
	}
	s.policies.WithLabelValues("rejected").Set(float64(len(s.rejected)))
	s.policies.WithLabelValues("accepted").Set(float64(len(s.inForce) - s.keptCount()))
	if !changed {
		return
	}
	ps := make([]egresspolicy.Policy, 0, len(s.inForce))
	for _, k := range slices.Sorted(maps.Keys(s.inForce)) {
		ps = append(ps, s.inForce[k])
	}
	set, err := egresspolicy.NewSet(ps)
	if err != nil { // every policy was validated: a bug
		s.log.Error("accepted policies do not make a set, the previous one stays", "err", err)
		return
	}
	s.mu.Lock()
	s.set = set
	s.mu.Unlock()
	s.log.Info("DNS egress policies published", "policies", set.Len())
	if s.opts.OnChange != nil {
		s.opts.OnChange(set)
	}
}

// sync brings the object key's policy in force and its status up to date,
// and reports whether what is in force changed.
func (s *Source) sync(ctx context.Context, key string) bool {
	obj, exists, _ := s.inf.GetStore().GetByKey(key)
	o, ok := obj.(*object)
	if !exists || !ok {
		_, had := s.inForce[key]
		delete(s.inForce, key)
		delete(s.rejected, key)
		delete(s.eventDue, key)
		return had
	}
	old, had := s.inForce[key]
	want := status{observedGeneration: o.generation}
	p, err := o.spec.Policy(o.Namespace, o.Name)
	if o.decodeErr != nil {
		err = o.decodeErr
	}
	switch {
	case err == nil:
		delete(s.rejected, key)
		s.inForce[key] = p
		want.accepted = &accepted{generation: o.generation, spec: o.rawSpec}
		want.cond = condition{status: "True", reason: ReasonAccepted, message: "in force"}
	default:
		msg := err.Error()
		s.rejected[key] = true
		delete(s.inForce, key)
		if o.kept != nil {
			if kp, kerr := o.kept.decoded.Policy(o.Namespace, o.Name); kerr == nil {
				s.inForce[key] = kp
				msg += fmt.Sprintf("; generation %d stays in force", o.kept.generation)
			}
		}
		want.cond = condition{status: "False", reason: ReasonInvalid, message: msg}
		if o.cond != want.cond || o.observedGeneration != o.generation {
			s.log.Warn("DNSEgressPolicy not accepted", "policy", key, "generation", o.generation, "problems", msg)
		}
	}
	if s.opts.WriteStatus {
		s.writeStatus(ctx, o, want)
	}
	now, has := s.inForce[key]
	return had != has || (has && !samePolicy(old, now))
}

// keptCount is the policies in force whose object is rejected (an
// earlier generation of it is in force).
func (s *Source) keptCount() int {
	n := 0
	for k := range s.rejected {
		if _, ok := s.inForce[k]; ok {
			n++
		}
	}
	return n
}

// samePolicy compares what the datapath would see of two policies.
func samePolicy(a, b egresspolicy.Policy) bool {
	ja, _ := json.Marshal([]any{a.PodSelector, a.Egress, a.Mode, a.FailMode, a.ClusterInternal})
	jb, _ := json.Marshal([]any{b.PodSelector, b.Egress, b.Mode, b.FailMode, b.ClusterInternal})
	return bytes.Equal(ja, jb)
}

// status is what the agent writes into an object's status.
type status struct {
	observedGeneration int64
	cond               condition
	accepted           *accepted // set when this generation is accepted
}

// writeStatus patches o's status to want unless it already says it, and
// for a rejected policy creates its Warning Event.
func (s *Source) writeStatus(ctx context.Context, o *object, want status) {
	same := o.cond == want.cond && o.observedGeneration == want.observedGeneration && o.condGeneration == want.observedGeneration &&
		(want.accepted == nil || (o.kept != nil && o.kept.generation == want.accepted.generation))
	if !same {
		ltt := o.condTime
		if o.cond.status != want.cond.status || ltt == "" {
			ltt = time.Now().UTC().Format(time.RFC3339)
		}
		st := map[string]any{
			"observedGeneration": want.observedGeneration,
			"conditions": []any{map[string]any{
				"type": ConditionAccepted, "status": want.cond.status, "reason": want.cond.reason, "message": want.cond.message,
				"observedGeneration": want.observedGeneration, "lastTransitionTime": ltt,
			}},
		}
		if want.accepted != nil {
			st["acceptedGeneration"] = want.accepted.generation
			st["acceptedSpec"] = want.accepted.spec
		}
		body, err := json.Marshal(map[string]any{"metadata": map[string]any{"resourceVersion": o.resourceVersion}, "status": st})
		if err == nil {
			s.writes.WithLabelValues("status").Inc()
			_, err = s.dc.Resource(GVR).Namespace(o.Namespace).Patch(ctx, o.Name, types.MergePatchType, body,
				metav1.PatchOptions{FieldManager: fieldManager}, "status")
		}
		switch {
		case err == nil:
		case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
			// A newer version (or the delete) is on its way.
		default:
			s.log.Warn("cannot write a DNSEgressPolicy's status, retrying", "policy", o.Key(), "err", err)
			s.retry(ctx, o.Key())
		}
	}
	// The agent that writes the rejection creates its Event; the others
	// find the status written and do not try.
	if want.cond.status == "False" && (!same || s.eventDue[o.Key()]) {
		s.event(ctx, o, want.cond.message)
	}
}

// event creates the Warning Event of o's rejected generation, once: its
// name is a hash of the object, generation and message, so the agents of
// every node create the same Event and all but the first find it there.
func (s *Source) event(ctx context.Context, o *object, msg string) {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s\x00%d\x00%s", o.uid, o.generation, msg)
	name := fmt.Sprintf("%s.%016x", o.Name, h.Sum64())
	if len(name) > 253 {
		name = name[len(name)-253:]
	}
	now := metav1.NewTime(time.Now())
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: o.Namespace},
		InvolvedObject: corev1.ObjectReference{APIVersion: Group + "/" + Version, Kind: Kind, Namespace: o.Namespace,
			Name: o.Name, UID: types.UID(o.uid), ResourceVersion: o.resourceVersion},
		Reason: ReasonInvalid, Message: "policy not accepted: " + msg, Type: corev1.EventTypeWarning,
		Source:         corev1.EventSource{Component: fieldManager, Host: s.opts.Node},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: "meshdns.io/meshdns-ebpf", ReportingInstance: s.opts.Node,
	}
	s.writes.WithLabelValues("event").Inc()
	err := s.kc.CoreV1().Post().Namespace(o.Namespace).Resource("events").Body(ev).Do(ctx).Error()
	if err != nil && !apierrors.IsAlreadyExists(err) {
		s.log.Warn("cannot create a DNSEgressPolicy's Event, retrying", "policy", o.Key(), "err", err)
		s.eventDue[o.Key()] = true
		s.retry(ctx, o.Key())
		return
	}
	delete(s.eventDue, o.Key())
}

// retryDelay is how long a failed status or Event write waits before the
// object is handled again.
const retryDelay = time.Second

// retry handles key again after retryDelay (the write may have been
// refused while RBAC was being granted, or the API server was away).
func (s *Source) retry(ctx context.Context, key string) {
	time.AfterFunc(retryDelay, func() {
		if ctx.Err() != nil {
			return
		}
		s.enqueue(key)
	})
}

// enqueue marks key to be handled by the worker.
func (s *Source) enqueue(key string) {
	s.mu.Lock()
	s.pending[key] = true
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}
