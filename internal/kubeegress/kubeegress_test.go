package kubeegress

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/dynamic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

var quiet = slog.New(slog.DiscardHandler)

func policy(ns, name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": Group + "/" + Version, "kind": Kind,
		"metadata": map[string]any{"namespace": ns, "name": name},
		"spec":     spec,
	}}
}

func rule(names []any, ports ...any) map[string]any {
	r := map[string]any{"names": names}
	if len(ports) > 0 {
		r["ports"] = ports
	}
	return r
}

// publisher records the sets a source publishes.
type publisher struct {
	mu   sync.Mutex
	last *egresspolicy.Set
	n    int
}

func (p *publisher) publish(s *egresspolicy.Set) { p.mu.Lock(); p.last, p.n = s, p.n+1; p.mu.Unlock() }
func (p *publisher) get() (*egresspolicy.Set, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last, p.n
}

// allows: a pod with labels in ns may use name (on some port).
func allows(s *egresspolicy.Set, ns string, labels map[string]string, name string) bool {
	p, ok := s.Select(egresspolicy.Workload{Namespace: ns, Labels: labels})
	if !ok {
		return false
	}
	_, ok = p.Allows(name)
	return ok
}

func startSource(t *testing.T, cp *kubetest.ControlPlane, node string) (*publisher, *prometheus.Registry) {
	t.Helper()
	pub := &publisher{}
	reg := prometheus.NewRegistry()
	src, err := New(cp.RESTConfig(t, "agent"), Options{OnChange: pub.publish, WriteStatus: true, Node: node, Logger: quiet, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	return pub, reg
}

// readStatus reads an object's Accepted condition and observedGeneration.
func readStatus(t *testing.T, dc dynamic.Interface, ns, name string) (status, message string, observed, generation int64, rv string) {
	t.Helper()
	u, err := dc.Resource(GVR).Namespace(ns).Get(kubetest.OpContext(t), name, metav1.GetOptions{})
	if err != nil {
		return "", err.Error(), 0, 0, ""
	}
	observed, _, _ = unstructured.NestedInt64(u.Object, "status", "observedGeneration")
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		if m, _ := c.(map[string]any); m["type"] == ConditionAccepted {
			status, _ = m["status"].(string)
			message, _ = m["message"].(string)
		}
	}
	return status, message, observed, u.GetGeneration(), u.GetResourceVersion()
}

func waitAccepted(t *testing.T, dc dynamic.Interface, ns, name, want string) string {
	t.Helper()
	var status, msg string
	var observed, gen int64
	if !testenv.WaitFor(20*time.Second, func() bool {
		status, msg, observed, gen, _ = readStatus(t, dc, ns, name)
		return status == want && observed == gen
	}) {
		t.Fatalf("%s/%s: Accepted=%q (%s), observedGeneration %d of %d; want %s", ns, name, status, msg, observed, gen, want)
	}
	return msg
}

func TestPoliciesAgainstTheAPIServer(t *testing.T) {
	cp := kubetest.Start(t, kubetest.Options{Users: []string{"agent"}})
	cp.InstallEgressPolicyCRD(t)
	cp.Grant(t, "agent", "", "meshdns-ebpf-egress", kubetest.ShippedRules(t, "egress-rbac.yaml", "meshdns-ebpf-egress"))
	cp.EnsureNamespace(t, "shop")
	dc := cp.DynamicClient()
	ctx := kubetest.OpContext(t)
	res := dc.Resource(GVR).Namespace("shop")

	// The schema rejects what it can before the agent sees it.
	for what, spec := range map[string]map[string]any{
		"mode":       {"mode": "deny", "egress": []any{rule([]any{"a.com"})}},
		"fail mode":  {"failMode": "closed", "egress": []any{rule([]any{"a.com"})}},
		"port 0":     {"egress": []any{rule([]any{"a.com"}, map[string]any{"port": 0})}},
		"port 65536": {"egress": []any{rule([]any{"a.com"}, map[string]any{"port": 65536})}},
		"protocol":   {"egress": []any{rule([]any{"a.com"}, map[string]any{"port": 53, "protocol": "SCTP"})}},
		"star":       {"egress": []any{rule([]any{"*"})}},
		"mid star":   {"egress": []any{rule([]any{"a.*.b"})}},
		"no names":   {"egress": []any{rule([]any{})}},
		"no egress":  {"mode": "audit"},
	} {
		if _, err := res.Create(ctx, policy("shop", "schema", spec), metav1.CreateOptions{}); err == nil {
			t.Errorf("the CRD schema accepted a bad %s", what)
			_ = res.Delete(ctx, "schema", metav1.DeleteOptions{})
		}
	}

	web := policy("shop", "web", map[string]any{
		"podSelector": map[string]any{"matchLabels": map[string]any{"app": "web"}},
		"egress":      []any{rule([]any{"api.example.com", "*.cdn.example.net"}, map[string]any{"port": 443})},
		"failMode":    "fail-closed",
	})
	// Valid for the schema, not for the agent: two problems.
	bad := policy("shop", "bad", map[string]any{
		"podSelector": map[string]any{"matchExpressions": []any{map[string]any{"key": "app", "operator": "In"}}},
		"egress":      []any{rule([]any{"ok.example.com", "-bad.example.com"})},
	})
	for _, u := range []*unstructured.Unstructured{web, bad} {
		if _, err := res.Create(ctx, u, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	pub, reg := startSource(t, cp, "node-a")
	waitAccepted(t, dc, "shop", "web", "True")
	msg := waitAccepted(t, dc, "shop", "bad", "False")
	for _, want := range []string{"spec.podSelector.matchExpressions[0].values", "spec.egress[0].names[1]"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the condition's message %q does not name %s", msg, want)
		}
	}
	var evMsg string
	if !testenv.WaitFor(20*time.Second, func() bool {
		evs, err := cp.AdminClient().CoreV1().Events("shop").List(ctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "bad").String()})
		if err != nil || len(evs.Items) != 1 {
			return false
		}
		ev := evs.Items[0]
		evMsg = ev.Message
		return ev.Type == "Warning" && ev.Reason == ReasonInvalid && ev.InvolvedObject.Kind == Kind && strings.Contains(ev.Message, "spec.egress[0].names[1]")
	}) {
		t.Fatalf("no Warning Event for the bad policy (last message %q)", evMsg)
	}

	// Only the valid policy is in force; the bad one not even in part.
	testenv.Eventually(t, 20*time.Second, func() bool {
		s, _ := pub.get()
		return s != nil && s.Len() == 1 && allows(s, "shop", map[string]string{"app": "web"}, "x.cdn.example.net")
	}, "the valid policy alone is not published")
	if s, _ := pub.get(); allows(s, "shop", map[string]string{"app": "web"}, "ok.example.com") || allows(s, "shop", nil, "ok.example.com") {
		t.Fatal("a name of the bad policy is in force")
	}

	// Fixed: accepted and published.
	fixed, err := res.Get(ctx, "bad", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedField(fixed.Object, []any{rule([]any{"ok.example.com"})}, "spec", "egress")
	_ = unstructured.SetNestedField(fixed.Object, map[string]any{}, "spec", "podSelector")
	if _, err := res.Update(ctx, fixed, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitAccepted(t, dc, "shop", "bad", "True")
	testenv.Eventually(t, 20*time.Second, func() bool {
		s, _ := pub.get()
		return s.Len() == 2 && allows(s, "shop", map[string]string{"app": "db"}, "ok.example.com")
	}, "the fixed policy is not published")

	// A bad edit of an accepted policy: rejected, and the accepted
	// generation stays in force.
	broken, err := res.Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedField(broken.Object, []any{rule([]any{"new.example.com", "bad-.example.com"})}, "spec", "egress")
	if _, err := res.Update(ctx, broken, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	msg = waitAccepted(t, dc, "shop", "web", "False")
	if !strings.Contains(msg, "spec.egress[0].names[1]") || !strings.Contains(msg, "generation 1 stays in force") {
		t.Errorf("message %q", msg)
	}
	webPod := map[string]string{"app": "web"}
	if s, _ := pub.get(); !allows(s, "shop", webPod, "api.example.com") || allows(s, "shop", webPod, "new.example.com") {
		t.Fatal("the bad edit changed what is in force")
	}

	// A second node's agent, started now, enforces the same (the kept
	// generation comes from the status) and writes nothing: every status
	// already says what it computes.
	_, _, _, _, rvWeb := readStatus(t, dc, "shop", "web")
	_, _, _, _, rvBad := readStatus(t, dc, "shop", "bad")
	pub2, reg2 := startSource(t, cp, "node-b")
	testenv.Eventually(t, 20*time.Second, func() bool { s, _ := pub2.get(); return s != nil }, "the second agent published nothing")
	if s, _ := pub2.get(); s.Len() != 2 || !allows(s, "shop", webPod, "api.example.com") || allows(s, "shop", webPod, "new.example.com") {
		t.Fatalf("the second agent enforces something else: %d policies", s.Len())
	}
	for _, kind := range []string{"status", "event"} {
		if n := metrictest.Value(t, reg2, "meshdns_egress_policy_status_writes_total", "kind", kind); n != 0 {
			t.Errorf("the second agent sent %v %s writes, want none", n, kind)
		}
	}
	if n := metrictest.Value(t, reg, "meshdns_egress_policy_status_writes_total", "kind", "event"); n != 2 {
		t.Errorf("the first agent sent %v Events, want 2 (bad, then web's bad edit)", n)
	}
	for _, r := range []*prometheus.Registry{reg, reg2} {
		if a, b := metrictest.Value(t, r, "meshdns_egress_policies", "state", "accepted"), metrictest.Value(t, r, "meshdns_egress_policies", "state", "rejected"); a != 1 || b != 1 {
			t.Errorf("meshdns_egress_policies accepted %v rejected %v, want 1 and 1", a, b)
		}
	}
	if _, _, _, _, rv := readStatus(t, dc, "shop", "web"); rv != rvWeb {
		t.Error("the second agent rewrote web's status")
	}
	if _, _, _, _, rv := readStatus(t, dc, "shop", "bad"); rv != rvBad {
		t.Error("the second agent rewrote bad's status")
	}
	evs, err := cp.AdminClient().CoreV1().Events("shop").List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "web").String()})
	if err != nil || len(evs.Items) != 1 {
		t.Errorf("events of web: %d, want 1 from two agents (%v)", len(evs.Items), err)
	}

	// Deleted: unpublished on both.
	if err := res.Delete(ctx, "web", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for i, p := range []*publisher{pub, pub2} {
		testenv.Eventually(t, 20*time.Second, func() bool {
			s, _ := p.get()
			_, ok := s.Select(egresspolicy.Workload{Namespace: "shop", Labels: webPod})
			return s.Len() == 1 && ok && !allows(s, "shop", webPod, "api.example.com")
		}, "agent %d still publishes the deleted policy", i+1)
	}
}
