package kubeegress

import (
	"encoding/json"
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/kubeclient"
)

// object is a DNSEgressPolicy as the source keeps it (the informer's
// transform makes it); immutable once made.
type object struct {
	kubeclient.Meta
	uid             string
	generation      int64
	resourceVersion string
	spec            Spec
	rawSpec         map[string]any
	decodeErr       error // the spec does not decode into Spec

	// What the status says now.
	observedGeneration int64
	cond               condition
	condGeneration     int64
	condTime           string
	kept               *accepted // status.acceptedSpec, when it decodes
}

// condition is the Accepted condition, as compared for idempotent writes.
type condition struct {
	status, reason, message string
}

// accepted is the last accepted spec the status keeps.
type accepted struct {
	generation int64
	spec       map[string]any
	decoded    Spec
}

// DeepCopyObject implements runtime.Object; the object is immutable.
func (o *object) DeepCopyObject() runtime.Object { return o }

func decodeSpec(raw map[string]any) (Spec, error) {
	var s Spec
	b, err := json.Marshal(raw)
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, egresspolicy.Problems{{Field: "spec", Detail: fmt.Sprintf("does not decode: %v", err)}}
	}
	return s, nil
}

func transform(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil // already transformed, or a tombstone
	}
	o := &object{Meta: kubeclient.Meta{Name: u.GetName(), Namespace: u.GetNamespace()}, uid: string(u.GetUID()),
		generation: u.GetGeneration(), resourceVersion: u.GetResourceVersion()}
	o.rawSpec, _, _ = unstructured.NestedMap(u.Object, "spec")
	o.spec, o.decodeErr = decodeSpec(o.rawSpec)
	o.observedGeneration, _, _ = unstructured.NestedInt64(u.Object, "status", "observedGeneration")
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if !ok || m["type"] != ConditionAccepted {
			continue
		}
		str := func(k string) string { s, _ := m[k].(string); return s }
		o.cond = condition{status: str("status"), reason: str("reason"), message: str("message")}
		o.condTime = str("lastTransitionTime")
		o.condGeneration, _, _ = unstructured.NestedInt64(m, "observedGeneration")
	}
	if raw, found, _ := unstructured.NestedMap(u.Object, "status", "acceptedSpec"); found {
		gen, _, _ := unstructured.NestedInt64(u.Object, "status", "acceptedGeneration")
		if spec, err := decodeSpec(raw); err == nil {
			o.kept = &accepted{generation: gen, spec: raw, decoded: spec}
		}
	}
	return o, nil
}
