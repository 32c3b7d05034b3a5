// Package budgetoverride gives workloads upstream budgets other than the
// flag defaults (--workload-qps, --workload-burst, --workload-max-pending),
// read from annotations on their Pod, else on its Namespace:
//
//	meshdns.io/upstream-qps          queries a second upstream (a decimal, 0: no limit)
//	meshdns.io/upstream-burst        queries at once within the rate (an integer, 0: one second's worth)
//	meshdns.io/upstream-max-pending  queries waiting for the upstream (an integer, 0: no limit)
//
// The first of the Pod and its Namespace that carries any of them sets the
// budget; what it leaves out comes from the flags (a burst it leaves out is
// one second's worth of its rate, when it sets the rate). An object with a bad
// value (not a number, negative, or an unknown meshdns.io/upstream-*
// annotation) sets nothing: the next one down applies, never part of it. It
// is logged once per object and value and counted in
// meshdns_budget_override_errors_total.
//
// Source implements the resolver's BudgetOverrides; it needs no Kubernetes
// packages (the agent gives it the annotations its Kubernetes source keeps).
package budgetoverride

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"

	"github.com/meshdns/meshdns-ebpf/internal/resolver"
)

// The annotations.
const (
	Prefix             = "meshdns.io/upstream-"
	AnnotationQPS      = Prefix + "qps"
	AnnotationBurst    = Prefix + "burst"
	AnnotationInFlight = Prefix + "max-pending"
)

// Override is what one object's annotations set.
type Override struct {
	QPS                  float64
	Burst, InFlight      int
	hasQPS, hasBurst     bool
	hasInFlight, present bool
}

// Set reports whether the object carries any budget annotation.
func (o Override) Set() bool { return o.present }

// Parse reads an object's budget annotations (others are ignored). Any bad
// one is an error, and the Override is then empty.
func Parse(annotations map[string]string) (Override, error) {
	var o Override
	var errs []string
	keys := make([]string, 0, len(annotations))
	for k := range annotations {
		if strings.HasPrefix(k, Prefix) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := strings.TrimSpace(annotations[k])
		switch k {
		case AnnotationQPS:
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f < 0 || math.IsInf(f, 0) || math.IsNaN(f) {
				errs = append(errs, fmt.Sprintf("%s=%q: want a rate of 0 or more", k, annotations[k]))
				continue
			}
			o.QPS, o.hasQPS = f, true
		case AnnotationBurst, AnnotationInFlight:
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				errs = append(errs, fmt.Sprintf("%s=%q: want an integer of 0 or more", k, annotations[k]))
				continue
			}
			if k == AnnotationBurst {
				o.Burst, o.hasBurst = n, true
			} else {
				o.InFlight, o.hasInFlight = n, true
			}
		default:
			errs = append(errs, fmt.Sprintf("%s: unknown (known: %s, %s, %s)", k, AnnotationQPS, AnnotationBurst, AnnotationInFlight))
		}
	}
	if len(errs) > 0 {
		return Override{}, fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	o.present = len(keys) > 0
	return o, nil
}

// Apply returns the default budget def with o's fields over it.
func (o Override) Apply(def resolver.BudgetLimits) resolver.BudgetLimits {
	l := def
	if o.hasQPS {
		l.QPS = o.QPS
		if !o.hasBurst {
			l.Burst = 0 // one second's worth of the object's rate
		}
	}
	if o.hasBurst {
		l.Burst = o.Burst
	}
	if o.hasInFlight {
		l.InFlight = o.InFlight
	}
	return l
}

// Resolve is the budget of a pod: the first of pod and namespace that is set,
// applied over def; false when neither is (def applies).
func Resolve(def resolver.BudgetLimits, pod, namespace Override) (resolver.BudgetLimits, bool) {
	for _, o := range []Override{pod, namespace} {
		if o.Set() {
			return o.Apply(def), true
		}
	}
	return def, false
}
