package budgetoverride

import (
	"log/slog"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Objects gives the annotations of this node's Pods and of Namespaces (nil
// for an object it does not know); internal/kubesource implements it.
type Objects interface {
	PodAnnotations(namespace, name string) map[string]string
	NamespaceAnnotations(name string) map[string]string
}

// Namer names a workload without blocking: false for a cgroup not named yet
// (workload.Namer.Known).
type Namer interface {
	Known(workload.Key) (workload.Identity, bool)
}

// maxReported bounds the objects remembered as reported bad.
const maxReported = 4096

// Source is the budget overrides of the workloads the namer names as pods.
// Safe for concurrent use; it is a prometheus.Collector of its error counter.
type Source struct {
	def    resolver.BudgetLimits
	objs   Objects
	namer  Namer
	log    *slog.Logger
	errors *prometheus.CounterVec

	mu       sync.Mutex
	reported map[string]string // "pod ns/name" or "namespace name" -> the bad value reported
}

// New returns the overrides over the default budget def (the flags').
func New(def resolver.BudgetLimits, objs Objects, namer Namer, log *slog.Logger) *Source {
	if log == nil {
		log = slog.Default()
	}
	s := &Source{def: def, objs: objs, namer: namer, log: log, reported: map[string]string{},
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "meshdns_budget_override_errors_total",
			Help: "Pods (kind=pod) and Namespaces (kind=namespace) found with a bad meshdns.io/upstream-* annotation, once per object and value: their override is ignored whole and the next one down (the Namespace's, then the flags') applies.",
		}, []string{"kind"}),
	}
	for _, kind := range []string{"pod", "namespace"} {
		s.errors.WithLabelValues(kind) // exported at 0 from the start
	}
	return s
}

// LimitsFor implements resolver.BudgetOverrides: the budget of k's pod from its
// annotations or its namespace's; false for a sender that is no pod (or not
// named yet), or whose pod and namespace set none.
func (s *Source) LimitsFor(k workload.Key) (resolver.BudgetLimits, bool) {
	id, ok := s.namer.Known(k)
	if !ok || id.Namespace == "" || id.Pod == "" {
		return resolver.BudgetLimits{}, false
	}
	pod := s.parse("pod", id.Namespace+"/"+id.Pod, s.objs.PodAnnotations(id.Namespace, id.Pod))
	var ns Override
	if !pod.Set() {
		ns = s.parse("namespace", id.Namespace, s.objs.NamespaceAnnotations(id.Namespace))
	}
	return Resolve(s.def, pod, ns)
}

// parse parses an object's annotations, reporting a bad value once.
func (s *Source) parse(kind, name string, ann map[string]string) Override {
	o, err := Parse(ann)
	key := kind + " " + name
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		delete(s.reported, key)
		return o
	}
	if s.reported[key] == err.Error() {
		return Override{}
	}
	if len(s.reported) >= maxReported {
		clear(s.reported)
	}
	s.reported[key] = err.Error()
	s.errors.WithLabelValues(kind).Inc()
	s.log.Warn("bad upstream budget annotation: the "+kind+"'s override is ignored", kind, name, "err", err)
	return Override{}
}

// Describe implements prometheus.Collector.
func (s *Source) Describe(ch chan<- *prometheus.Desc) { s.errors.Describe(ch) }

// Collect implements prometheus.Collector.
func (s *Source) Collect(ch chan<- prometheus.Metric) { s.errors.Collect(ch) }
