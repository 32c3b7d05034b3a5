package istioegress

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/meshsource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

type publisher struct {
	mu   sync.Mutex
	last *egresspolicy.Set
}

func (p *publisher) publish(s *egresspolicy.Set) { p.mu.Lock(); p.last = s; p.mu.Unlock() }
func (p *publisher) get() *egresspolicy.Set      { p.mu.Lock(); defer p.mu.Unlock(); return p.last }

// may reports whether a pod of ns may use name under the last set, and
// whether any policy selects it at all.
func (p *publisher) may(ns, name string) (selected, allowed bool) {
	s := p.get()
	pol, ok := s.Select(egresspolicy.Workload{Namespace: ns})
	if !ok {
		return false, false
	}
	_, allowed = pol.Allows(name)
	return true, allowed
}

func TestRegistryOnlyAgainstTheAPIServer(t *testing.T) {
	cp := kubetest.Start(t, kubetest.Options{Users: []string{"agent"}})
	cp.InstallServiceEntryCRD(t)
	cp.InstallIstioCRD(t, kubetest.SidecarCRD)
	// The shipped roles: the egress role (mesh config, Sidecars) and the
	// agent's role (ServiceEntries, which meshsource reads too).
	cp.Grant(t, "agent", "", "egress", kubetest.ShippedRules(t, "egress-rbac.yaml", "meshdns-ebpf-egress"))
	cp.Grant(t, "agent", "", "names", kubetest.ShippedRules(t, "rbac.yaml", "meshdns-ebpf"))
	for _, ns := range []string{"istio-system", "shop", "open"} {
		cp.EnsureNamespace(t, ns)
	}
	ctx := kubetest.OpContext(t)
	dc := cp.DynamicClient()
	core := cp.AdminClient().CoreV1()
	mesh := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: MeshConfigMap},
		Data: map[string]string{MeshConfigKey: "accessLogFile: /dev/stdout\noutboundTrafficPolicy:\n  mode: REGISTRY_ONLY\n"}}
	if _, err := core.ConfigMaps("istio-system").Create(ctx, mesh, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	create := func(gvrRes string, ns, name string, spec map[string]any) {
		t.Helper()
		gvr := kubetest.ServiceEntryGVR
		kind := "ServiceEntry"
		if gvrRes == "sidecars" {
			gvr, kind = sidecarGVR, "Sidecar"
		}
		u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "networking.istio.io/v1", "kind": kind,
			"metadata": map[string]any{"namespace": ns, "name": name}, "spec": spec}}
		if _, err := dc.Resource(gvr).Namespace(ns).Create(ctx, u, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	create("serviceentries", "shop", "pay", map[string]any{"hosts": []any{"api.pay.example.com"}, "resolution": "DNS",
		"ports": []any{map[string]any{"number": 443, "name": "https", "protocol": "TLS"}}})
	create("serviceentries", "shop", "local", map[string]any{"hosts": []any{"db.shop.example.org"}, "exportTo": []any{"."},
		"resolution": "DNS", "ports": []any{map[string]any{"number": 5432, "name": "pg", "protocol": "TCP"}}})

	// The ServiceEntries come from the name source of ServiceEntries,
	// running in a name store as in the agent.
	quiet := slog.New(slog.DiscardHandler)
	se, err := meshsource.NewServiceEntries(cp.RESTConfig(t, "agent"), quiet)
	if err != nil {
		t.Fatal(err)
	}
	st, err := names.New(names.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Add(se, names.SourceOptions{Priority: names.PriorityServiceEntries}); err != nil {
		t.Fatal(err)
	}
	if err := st.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })

	pub := &publisher{}
	src, err := New(cp.RESTConfig(t, "agent"), Options{ServiceEntries: se, OnChange: pub.publish, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })

	type want struct {
		ns, name          string
		selected, allowed bool
	}
	check := func(what string, wants ...want) {
		t.Helper()
		var bad []want
		if !testenv.WaitFor(20*time.Second, func() bool {
			if pub.get() == nil {
				return false
			}
			bad = bad[:0]
			for _, w := range wants {
				if sel, ok := pub.may(w.ns, w.name); sel != w.selected || ok != w.allowed {
					bad = append(bad, w)
				}
			}
			return len(bad) == 0
		}) {
			t.Fatalf("%s: not as wanted: %+v", what, bad)
		}
	}
	// Mesh-wide REGISTRY_ONLY: every namespace, the hosts exported to it
	// and the cluster's Services.
	check("mesh config",
		want{"open", "api.pay.example.com", true, true},
		want{"open", "db.shop.example.org", true, false},
		want{"open", "example.com", true, false},
		want{"open", "web.default.svc.cluster.local", true, true},
		want{"shop", "db.shop.example.org", true, true},
	)

	// A namespace's Sidecar opts it out; a new ServiceEntry is allowed.
	create("sidecars", "open", "default", map[string]any{"outboundTrafficPolicy": map[string]any{"mode": "ALLOW_ANY"}})
	create("serviceentries", "shop", "more", map[string]any{"hosts": []any{"*.cdn.example.net"}, "resolution": "NONE",
		"ports": []any{map[string]any{"number": 443, "name": "https", "protocol": "TLS"}}})
	check("Sidecar ALLOW_ANY in open, a new entry",
		want{"open", "example.com", false, false},
		want{"shop", "a.b.cdn.example.net", true, true},
		want{"other", "a.b.cdn.example.net", true, true},
	)

	// The mesh config back to ALLOW_ANY: only a namespace whose Sidecar
	// says REGISTRY_ONLY stays restricted.
	mesh.Data[MeshConfigKey] = "outboundTrafficPolicy:\n  mode: ALLOW_ANY\n"
	if _, err := core.ConfigMaps("istio-system").Update(ctx, mesh, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	create("sidecars", "shop", "default", map[string]any{"outboundTrafficPolicy": map[string]any{"mode": "REGISTRY_ONLY"}})
	check("mesh ALLOW_ANY, shop's Sidecar REGISTRY_ONLY",
		want{"other", "example.com", false, false},
		want{"open", "example.com", false, false},
		want{"shop", "db.shop.example.org", true, true},
		want{"shop", "api.pay.example.com", true, true},
		want{"shop", "example.com", true, false},
	)

	// Its Sidecar deleted: nothing restricted.
	if err := dc.Resource(sidecarGVR).Namespace("shop").Delete(ctx, "default", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 20*time.Second, func() bool { return pub.get().Len() == 0 }, "policies remain after the Sidecar went")
}
