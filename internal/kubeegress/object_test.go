package kubeegress

import (
	"errors"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
)

func TestTransformReadsSpecAndStatus(t *testing.T) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"metadata": map[string]any{"namespace": "shop", "name": "web", "uid": "u1", "generation": int64(3), "resourceVersion": "42"},
		"spec":     map[string]any{"egress": []any{map[string]any{"names": []any{"a.example.com"}, "ports": []any{map[string]any{"port": int64(443)}}}}},
		"status": map[string]any{
			"observedGeneration": int64(2),
			"acceptedGeneration": int64(1),
			"acceptedSpec":       map[string]any{"egress": []any{map[string]any{"names": []any{"old.example.com"}}}},
			"conditions": []any{map[string]any{"type": "Accepted", "status": "False", "reason": "Invalid", "message": "m",
				"observedGeneration": int64(2), "lastTransitionTime": "2026-01-01T00:00:00Z"}},
		},
	}}
	got, err := transform(u)
	if err != nil {
		t.Fatal(err)
	}
	o := got.(*object)
	if o.Key() != "shop/web" || o.generation != 3 || o.resourceVersion != "42" || o.observedGeneration != 2 ||
		o.cond != (condition{"False", "Invalid", "m"}) || o.condGeneration != 2 || o.condTime != "2026-01-01T00:00:00Z" {
		t.Fatalf("object %+v", o)
	}
	if o.kept == nil || o.kept.generation != 1 || o.kept.decoded.Egress[0].Names[0] != "old.example.com" {
		t.Fatalf("kept %+v", o.kept)
	}
	p, err := o.spec.Policy(o.Namespace, o.Name)
	if err != nil || p.Egress[0].Ports[0] != (egresspolicy.Port{Port: 443, Protocol: egresspolicy.TCP}) || p.Mode != egresspolicy.Enforce {
		t.Fatalf("policy %+v, %v", p, err)
	}

	// A spec of the wrong shape (the schema would refuse it) is a problem
	// of "spec", not a panic or a silently empty policy.
	u.Object["spec"] = map[string]any{"egress": "not a list"}
	got, _ = transform(u)
	var ps egresspolicy.Problems
	if o := got.(*object); !errors.As(o.decodeErr, &ps) || ps[0].Field != "spec" {
		t.Fatalf("decode error %v", o.decodeErr)
	}
}
