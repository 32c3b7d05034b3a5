package kubesource_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/kubetest"
	"github.com/meshdns/meshdns-ebpf/internal/meshsource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Every start of the Kubernetes and ServiceEntry sources publishes a first
// table that holds exactly the names the API server's Services,
// EndpointSlices and ServiceEntries give,
// whatever order the two informers list in and their handlers run in,
// while other Services and their slices are created and deleted during the
// start; once that churn stops, the table follows the API server exactly.
// (A start used to publish a table without a Service that existed long
// before, and answer NXDOMAIN for it until the Service next changed.)
//
// MESHDNS_SYNC_STARTS sets the number of starts (default 120).
func TestFirstTableMatchesAPIServer(t *testing.T) {
	starts := 120
	if v := os.Getenv("MESHDNS_SYNC_STARTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("MESHDNS_SYNC_STARTS=%q: want a positive number", v)
		}
		starts = n
	}
	cp := kubetest.Start(t, kubetest.Options{})
	cs := cp.AdminClient()
	rc := cp.RESTConfig(t, kubetest.Admin)
	cp.InstallServiceEntryCRD(t)
	createPopulation(t, cp, []string{"a", "b"}, 30)
	base := apiNames(t, cp) // default/kubernetes included

	var firstWrong, stayedWrong int
	for i := range starts {
		// Services created and deleted while the source starts, each with
		// its slice: they may or may not be in the first table, but nothing
		// else may differ, and once the churn stops the table must follow.
		churn, gone := churnNames(i), churnNames(i-1)
		var wg sync.WaitGroup
		for j, name := range churn {
			wg.Go(func() {
				createServiceWithSlice(t, cs, "a", name, j%3 == 0, creation(j%3))
				createServiceEntry(t, cp, "a", name)
			})
		}
		for _, name := range gone {
			wg.Go(func() {
				deleteServiceWithSlice(t, cs, "a", name)
				deleteServiceEntry(t, cp, "a", name)
			})
		}
		stopBusy := busy(runtime.GOMAXPROCS(0))
		store, first := startSource(t, rc)
		stopBusy()
		if missing, extra := diff(tableNames(first), base, append(churn, gone...)); len(missing)+len(extra) > 0 {
			firstWrong++
			t.Errorf("start %d: first table: missing %v, extra %v", i, missing, extra)
		}
		wg.Wait()
		var have, want []string
		if !testenv.WaitFor(5*time.Second, func() bool {
			have, want = tableNames(store.Table()), apiNames(t, cp)
			return slices.Equal(have, want)
		}) {
			stayedWrong++
			missing, extra := diff(have, want, nil)
			t.Errorf("start %d: the table did not follow the API server within 5 s: missing %v, extra %v", i, missing, extra)
		}
		for _, st := range store.Status() {
			if st.AuditMismatches > 0 {
				t.Logf("start %d: %s: %d audit mismatches before the first sync", i, st.Name, st.AuditMismatches)
			}
		}
		store.Close()
	}
	t.Logf("%d starts against %d names (+%d Services created and %d deleted during each start): %d first tables wrong, %d stayed wrong",
		starts, len(base), churnPerStart, churnPerStart, firstWrong, stayedWrong)
}

// churnPerStart Services are created, and the previous start's deleted,
// during each start.
const churnPerStart = 8

func churnNames(start int) []string {
	if start < 0 {
		return nil
	}
	out := make([]string, churnPerStart)
	for j := range out {
		out[j] = fmt.Sprintf("churn-%d-%d", start, j)
	}
	return out
}

// diff compares names with the API server's (want), leaving out the names
// of the Services changed during the start.
func diff(have, want []string, changed []string) (missing, extra []string) {
	skip := func(n string) bool {
		return slices.ContainsFunc(changed, func(c string) bool {
			name := c + ".a.svc.cluster.local."
			return n == name || strings.HasSuffix(n, "."+name) || n == seHost(c)
		})
	}
	for _, w := range want {
		if !skip(w) && !slices.Contains(have, w) {
			missing = append(missing, w)
		}
	}
	for _, h := range have {
		if !skip(h) && !slices.Contains(want, h) {
			extra = append(extra, h)
		}
	}
	return missing, extra
}

// tableNames lists the names of Services and ServiceEntries of a table,
// sorted.
func tableNames(tab *nametable.Table) []string {
	var out []string
	tab.Each(func(owner string, _ *nametable.Name) bool {
		if strings.HasSuffix(owner, ".svc.cluster.local.") || strings.HasSuffix(owner, seDomain) {
			out = append(out, owner)
		}
		return true
	})
	slices.Sort(out)
	return slices.Compact(out)
}

// apiNames lists the names the API server's objects give, sorted: every
// Service's name, for a headless Service one name per ready endpoint
// address (the Kubernetes DNS specification), and every ServiceEntry's
// host.
func apiNames(t *testing.T, cp *kubetest.ControlPlane) []string {
	t.Helper()
	ctx := context.Background()
	cs := cp.AdminClient()
	entries, err := cp.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list ServiceEntries: %v", err)
	}
	var out []string
	for _, se := range entries.Items {
		hosts, _, _ := unstructured.NestedStringSlice(se.Object, "spec", "hosts")
		for _, h := range hosts {
			out = append(out, h+".")
		}
	}
	svcs, err := cs.CoreV1().Services("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list Services: %v", err)
	}
	eps, err := cs.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list EndpointSlices: %v", err)
	}
	for _, s := range svcs.Items {
		name := s.Name + "." + s.Namespace + ".svc.cluster.local."
		out = append(out, name)
		if s.Spec.ClusterIP != corev1.ClusterIPNone {
			continue
		}
		for _, es := range eps.Items {
			if es.Namespace != s.Namespace || es.Labels[discoveryv1.LabelServiceName] != s.Name {
				continue
			}
			for _, e := range es.Endpoints {
				if e.Conditions.Ready != nil && !*e.Conditions.Ready {
					continue
				}
				for _, a := range e.Addresses {
					out = append(out, strings.ReplaceAll(a, ".", "-")+"."+name)
				}
			}
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// busy keeps n goroutines computing until the returned stop is called: a
// busy node, whose scheduler preempts the source's handlers at any point
// (where the race between the two informers' handlers was seen).
func busy(n int) (stop func()) {
	var done atomic.Bool
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			x := 1
			for !done.Load() {
				for i := range 1000 {
					x = x*31 + i
				}
			}
			sink.Add(int64(x))
		})
	}
	return func() { done.Store(true); wg.Wait() }
}

var sink atomic.Int64

// startSource starts a name store with the Kubernetes and ServiceEntry
// sources, as the agent does, and returns it with its first published
// table.
func startSource(t *testing.T, rc *rest.Config) (*names.Store, *nametable.Table) {
	t.Helper()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	store, err := names.New(names.Config{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	src, err := kubesource.New(kubesource.Config{Name: "kubernetes", Rest: rc, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Add(src, names.SourceOptions{Priority: names.PriorityKubernetes}); err != nil {
		t.Fatal(err)
	}
	se, err := meshsource.NewServiceEntries(rc, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Add(se, names.SourceOptions{Priority: names.PriorityServiceEntries}); err != nil {
		t.Fatal(err)
	}
	if err := store.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	var first *nametable.Table
	if !testenv.WaitFor(30*time.Second, func() bool { first = store.Table(); return first != nil }) {
		store.Close()
		t.Fatalf("no table within 30 s: %v", store.Ready())
	}
	return store, first
}

// createPopulation makes n Services in each namespace, each with an
// EndpointSlice (every third headless: its names come from its slice), and
// a ServiceEntry for every fifth.
func createPopulation(t *testing.T, cp *kubetest.ControlPlane, namespaces []string, n int) {
	t.Helper()
	for _, ns := range namespaces {
		cp.EnsureNamespace(t, ns)
		for i := range n {
			name := fmt.Sprintf("svc-%d", i)
			createServiceWithSlice(t, cp.AdminClient(), ns, name, i%3 == 0, serviceFirst)
			if i%5 == 0 {
				createServiceEntry(t, cp, ns, ns+"-"+name)
			}
		}
	}
}

// seDomain is the domain of the test's ServiceEntry hosts.
const seDomain = ".entries.test."

func seHost(name string) string { return name + seDomain }

// createServiceEntry creates a ServiceEntry with one host, name.entries.test,
// and a static address.
func createServiceEntry(t *testing.T, cp *kubetest.ControlPlane, ns, name string) {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": kubetest.ServiceEntryGVR.GroupVersion().String(),
		"kind":       "ServiceEntry",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{
			"hosts":      []any{strings.TrimSuffix(seHost(name), ".")},
			"addresses":  []any{"240.240.7.1"},
			"resolution": "STATIC",
			"ports":      []any{map[string]any{"number": int64(80), "name": "http", "protocol": "HTTP"}},
			"endpoints":  []any{map[string]any{"address": "10.244.7.1"}},
		},
	}}
	_, err := cp.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace(ns).Create(context.Background(), u, metav1.CreateOptions{})
	if err != nil {
		t.Errorf("create ServiceEntry %s/%s: %v", ns, name, err)
	}
}

func deleteServiceEntry(t *testing.T, cp *kubetest.ControlPlane, ns, name string) {
	err := cp.DynamicClient().Resource(kubetest.ServiceEntryGVR).Namespace(ns).Delete(context.Background(), name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete ServiceEntry %s/%s: %v", ns, name, err)
	}
}

// creation is the order a Service and its slice are created in.
type creation int

const (
	serviceFirst creation = iota
	sliceFirst
	together // both at once: the two informers' handlers meet on one key
)

// createServiceWithSlice creates a Service without a selector and an
// EndpointSlice for it, as a controller of custom endpoints does.
func createServiceWithSlice(t *testing.T, cs kubernetes.Interface, ns, name string, headless bool, order creation) {
	ctx := context.Background()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{
			Name: "http", Port: 80, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(8080),
		}}},
	}
	if headless {
		svc.Spec.ClusterIP = corev1.ClusterIPNone
	}
	es := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-1", Labels: map[string]string{
			discoveryv1.LabelServiceName: name, discoveryv1.LabelManagedBy: "meshdns-test",
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080), Protocol: ptr.To(corev1.ProtocolTCP)}},
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"10.244.1.10"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}},
			{Addresses: []string{"10.244.1.11"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}},
		},
	}
	createSvc := func() {
		if _, err := cs.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{}); err != nil {
			t.Errorf("create Service %s/%s: %v", ns, name, err)
		}
	}
	createSlice := func() {
		if _, err := cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, es, metav1.CreateOptions{}); err != nil {
			t.Errorf("create EndpointSlice %s/%s: %v", ns, es.Name, err)
		}
	}
	switch order {
	case sliceFirst:
		createSlice()
		createSvc()
	case together:
		var wg sync.WaitGroup
		wg.Go(createSlice)
		createSvc()
		wg.Wait()
	default:
		createSvc()
		createSlice()
	}
}

func deleteServiceWithSlice(t *testing.T, cs kubernetes.Interface, ns, name string) {
	ctx := context.Background()
	if err := cs.DiscoveryV1().EndpointSlices(ns).Delete(ctx, name+"-1", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete EndpointSlice %s/%s-1: %v", ns, name, err)
	}
	if err := cs.CoreV1().Services(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete Service %s/%s: %v", ns, name, err)
	}
}
