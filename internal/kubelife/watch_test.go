package kubelife

import (
	"context"
	"encoding/base64"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// The pod a bound service account token names.
func TestSelfFromToken(t *testing.T) {
	claims := `{"aud":["x"],"kubernetes.io":{"namespace":"meshdns-system","pod":{"name":"meshdns-ebpf-7xk2p","uid":"0a1b"},"serviceaccount":{"name":"meshdns-ebpf"}}}`
	jwt := func(payload string) string {
		return "eyJhbGciOiJSUzI1NiJ9." + base64.RawURLEncoding.EncodeToString([]byte(payload)) + ".c2ln"
	}
	got, err := selfFromToken(jwt(claims))
	if err != nil || got != (Self{Namespace: "meshdns-system", Pod: "meshdns-ebpf-7xk2p"}) {
		t.Errorf("selfFromToken = %+v, %v", got, err)
	}
	for _, bad := range []string{"not-a-jwt", jwt(`{"kubernetes.io":{"namespace":"ns"}}`), jwt(`[`)} {
		if _, err := selfFromToken(bad); err == nil {
			t.Errorf("selfFromToken(%q): no error", bad)
		}
	}
}

const agentUser = "agent"

// grantLifecycle gives the agent user what deploy/kubernetes/rbac.yaml
// gives the agent for this (the pods rule of its ClusterRole, its lifecycle
// roles), for namespace ns and DaemonSet ds.
func grantLifecycle(t *testing.T, cp *kubetest.ControlPlane, ns, ds string) (revoke func()) {
	t.Helper()
	verbs := []string{"get", "list", "watch"}
	revokeCluster := cp.Grant(t, agentUser, "", "lifecycle-"+ns, []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: verbs},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, ResourceNames: []string{ns}, Verbs: verbs},
	})
	revokeNS := cp.Grant(t, agentUser, ns, "lifecycle", []rbacv1.PolicyRule{
		{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{ds}, Verbs: verbs},
	})
	return func() { revokeCluster(); revokeNS() }
}

// startWatch runs a Watch as the agent user for pod ns/pod on node-a once it
// has seen its objects (a first verdict of restart).
func startWatch(t *testing.T, cp *kubetest.ControlPlane, ns, pod string) *Watch {
	t.Helper()
	w, err := New(Config{Rest: cp.RESTConfig(t, agentUser), Self: Self{Namespace: ns, Pod: pod}, Node: "node-a"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := w.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	if !testenv.WaitFor(kubetest.WaitTimeout, func() bool { return w.synced() }) {
		t.Fatalf("the watches did not sync: %v", w.errs)
	}
	return w
}

func verdict(t *testing.T, w *Watch) Verdict {
	t.Helper()
	start := time.Now()
	v := w.Verdict(t.Context(), 2*time.Second)
	t.Logf("verdict after %v: %+v", time.Since(start).Round(time.Millisecond), v)
	return v
}

// What a SIGTERM means, read from the real API server: a restart while the
// agent's namespace and DaemonSet stand and no other pod of it is on the
// node; a handover once a replacement pod (not being deleted) is there; an
// uninstall once the namespace or the DaemonSet is being deleted, also when
// the agent's roles and their bindings were deleted first (kubectl delete -k
// deletes them in the same breath): watches that were opened keep delivering.
func TestVerdicts(t *testing.T) {
	cp := kubetest.Start(t, kubetest.Options{Users: []string{agentUser}})
	for _, how := range []string{"namespace deleted", "daemonset deleted"} {
		t.Run(how, func(t *testing.T) {
			ns := strings.ReplaceAll(how, " ", "-")
			cp.EnsureNamespace(t, ns)
			_, ref := cp.CreateDaemonSet(t, ns, "meshdns-ebpf")
			cp.CreatePod(t, kubetest.Pod{Namespace: ns, Name: "agent-a", Node: "node-a", Controller: ref})
			removeRBAC := grantLifecycle(t, cp, ns, "meshdns-ebpf")
			w := startWatch(t, cp, ns, "agent-a")
			if v := verdict(t, w); v.Uninstall || v.Successor != "" {
				t.Fatalf("nothing deleted, no other pod: %+v, want a restart", v)
			}

			cp.CreatePod(t, kubetest.Pod{Namespace: ns, Name: "agent-b", Node: "node-a", Controller: ref})
			cp.CreatePod(t, kubetest.Pod{Namespace: ns, Name: "agent-other-node", Node: "node-b", Controller: ref})
			cp.CreatePod(t, kubetest.Pod{Namespace: ns, Name: "not-ours", Node: "node-a"})
			if v := verdict(t, w); v.Successor != "agent-b" || v.Uninstall {
				t.Errorf("a pod of the daemonset starts on the node: %+v, want successor agent-b", v)
			}
			cp.DeletePodGracefully(t, ns, "agent-b")
			if !testenv.WaitFor(kubetest.WaitTimeout, func() bool { return w.verdict().Successor == "" }) {
				t.Errorf("the replacement is being deleted too: %+v, want no successor", w.verdict())
			}
			if v := verdict(t, w); v.Successor != "" || v.Uninstall {
				t.Errorf("the replacement is being deleted too: %+v, want a restart", v)
			}

			removeRBAC()
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()
			var err error
			if how == "namespace deleted" {
				err = cp.AdminClient().CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})
			} else {
				err = cp.AdminClient().AppsV1().DaemonSets(ns).Delete(ctx, "meshdns-ebpf", metav1.DeleteOptions{})
			}
			if err != nil {
				t.Fatal(err)
			}
			if v := verdict(t, w); !v.Uninstall {
				t.Errorf("%s after the agent's roles were: %+v, want an uninstall", how, v)
			}
		})
	}
}
