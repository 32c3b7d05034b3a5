package kubetest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	// istio.io/api is a test-only dependency: kubetest reads Istio's real CRDs
	// from its module directory, and this import (constants only) keeps the module
	// in go.mod. The agent binary never imports kubetest.
	_ "istio.io/api/label"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// ServiceEntryCRD is the name of Istio's ServiceEntry CustomResourceDefinition.
const ServiceEntryCRD = "serviceentries.networking.istio.io"

// ServiceEntryGVR is the resource of ServiceEntries at version v1; the CRD also
// serves v1beta1 and v1alpha3 (same schema).
var ServiceEntryGVR = schema.GroupVersionResource{Group: "networking.istio.io", Version: "v1", Resource: "serviceentries"}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// EgressPolicyCRD is the name of the DNSEgressPolicy CRD, and
// EgressPolicyCRDFile its file in the repository (what kubectl apply and the
// chart install).
const (
	EgressPolicyCRD     = "dnsegresspolicies.meshdns.io"
	EgressPolicyCRDFile = "deploy/kubernetes/crds/dnsegresspolicies.yaml"
)

// EgressPolicyGVR is the resource of DNSEgressPolicies.
var EgressPolicyGVR = schema.GroupVersionResource{Group: "meshdns.io", Version: "v1alpha1", Resource: "dnsegresspolicies"}

// InstallEgressPolicyCRD installs the repository's DNSEgressPolicy CRD and waits
// until the API server serves it and its first-creates window (see
// InstallServiceEntryCRD) is over.
func (cp *ControlPlane) InstallEgressPolicyCRD(t testing.TB) {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	cp.InstallCRDs(t, filepath.Join(root, EgressPolicyCRDFile))
	ctx, cancel := opContext(t)
	defer cancel()
	probe := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": EgressPolicyGVR.GroupVersion().String(),
		"kind":       "DNSEgressPolicy",
		"metadata":   map[string]any{"name": "kubetest-probe", "namespace": "default"},
		"spec":       map[string]any{"egress": []any{map[string]any{"names": []any{"probe.kubetest.invalid"}}}},
	}}
	if err := waitFor(func() error {
		_, err := cp.dynamic.Resource(EgressPolicyGVR).Namespace("default").Create(ctx, probe,
			metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}); err != nil {
		t.Fatalf("kubetest: dry-run create of a DNSEgressPolicy: %v", err)
	}
}

// istioCRDFile is where Istio keeps its generated CRDs in the istio.io/api module.
const istioCRDFile = "kubernetes/customresourcedefinitions.gen.yaml"

// InstallServiceEntryCRD installs Istio's ServiceEntry CRD, exactly as the
// istio.io/api module of go.mod ships it, and waits until the API server serves it.
func (cp *ControlPlane) InstallServiceEntryCRD(t testing.TB) {
	t.Helper()
	crd, err := istioCRD(ServiceEntryCRD)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	ctx, cancel := opContext(t)
	defer cancel()
	crd = crd.DeepCopy()
	if _, err := cp.dynamic.Resource(crdGVR).Create(ctx, crd, metav1.CreateOptions{}); err != nil {
		t.Fatalf("kubetest: create CRD %s: %v", ServiceEntryCRD, err)
	}
	cp.waitEstablished(t, ServiceEntryCRD)
	// Established means the API server serves it; a list through the new resource
	// proves the discovery and storage paths are up too.
	cp.waitCRD(t, ServiceEntryCRD, func(*unstructured.Unstructured, error) error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := cp.dynamic.Resource(ServiceEntryGVR).List(ctx, metav1.ListOptions{Limit: 1})
		return err
	})
	// kube-apiserver holds every create of a custom resource for 2 s while its CRD
	// was Established less than 2 s ago (customresource_handler.go, for HA
	// servers). One dry-run create absorbs that window here, so a test timing its
	// own creates is not charged 2 s: it returns either at once (the window is
	// over) or after the server's sleep (which began inside the window).
	probe := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": ServiceEntryGVR.GroupVersion().String(),
		"kind":       "ServiceEntry",
		"metadata":   map[string]any{"name": "kubetest-probe", "namespace": "default"},
		"spec":       map[string]any{"hosts": []any{"probe.kubetest.invalid"}, "resolution": "DNS"},
	}}
	if _, err := cp.dynamic.Resource(ServiceEntryGVR).Namespace("default").Create(ctx, probe,
		metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Fatalf("kubetest: dry-run create of a ServiceEntry: %v", err)
	}
}

// SidecarCRD is the name of Istio's Sidecar CustomResourceDefinition.
const SidecarCRD = "sidecars.networking.istio.io"

// InstallIstioCRD installs Istio's CRD name (such as SidecarCRD), exactly as the
// istio.io/api module of go.mod ships it, and waits until it is Established.
func (cp *ControlPlane) InstallIstioCRD(t testing.TB, name string) {
	t.Helper()
	crd, err := istioCRD(name)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	ctx, cancel := opContext(t)
	defer cancel()
	if _, err := cp.dynamic.Resource(crdGVR).Create(ctx, crd.DeepCopy(), metav1.CreateOptions{}); err != nil {
		t.Fatalf("kubetest: create CRD %s: %v", name, err)
	}
	cp.waitEstablished(t, name)
}

// UninstallServiceEntryCRD deletes the ServiceEntry CRD and waits until it (and
// with it every ServiceEntry) is gone and its resource is no longer served.
func (cp *ControlPlane) UninstallServiceEntryCRD(t testing.TB) {
	t.Helper()
	ctx, cancel := opContext(t)
	defer cancel()
	if err := cp.dynamic.Resource(crdGVR).Delete(ctx, ServiceEntryCRD, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("kubetest: delete CRD %s: %v", ServiceEntryCRD, err)
	}
	cp.waitCRD(t, ServiceEntryCRD, func(_ *unstructured.Unstructured, err error) error {
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		return errors.New("still present (its instances are being deleted)")
	})
	// The CRD object goes before the API server stops serving its resource (the
	// handler drops its storage when its own informer sees the delete): wait for
	// that too, so "uninstalled" means what a client sees.
	cp.waitCRD(t, ServiceEntryCRD, func(*unstructured.Unstructured, error) error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := cp.dynamic.Resource(ServiceEntryGVR).List(ctx, metav1.ListOptions{Limit: 1})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err != nil {
			return err
		}
		return errors.New("still served")
	})
}

// waitCRD polls the CRD name until check accepts it (or its get error).
func (cp *ControlPlane) waitCRD(t testing.TB, name string, check func(*unstructured.Unstructured, error) error) {
	t.Helper()
	var err error
	if !testenv.WaitFor(WaitTimeout, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		u, gerr := cp.dynamic.Resource(crdGVR).Get(ctx, name, metav1.GetOptions{})
		err = check(u, gerr)
		return err == nil
	}) {
		t.Fatalf("kubetest: CRD %s: %v after %v", name, err, WaitTimeout)
	}
}

// waitEstablished waits until the API server serves the CRD name.
func (cp *ControlPlane) waitEstablished(t testing.TB, name string) {
	t.Helper()
	cp.waitCRD(t, name, func(u *unstructured.Unstructured, err error) error {
		if err != nil {
			return err
		}
		if !crdEstablished(u) {
			return errors.New("not Established yet")
		}
		return nil
	})
}

func crdEstablished(u *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

var (
	istioCRDsOnce sync.Once
	istioCRDs     map[string]*unstructured.Unstructured
	istioCRDsErr  error
)

// istioCRD returns the CRD name from istio.io/api's CRD file (read once per test
// binary).
func istioCRD(name string) (*unstructured.Unstructured, error) {
	istioCRDsOnce.Do(func() { istioCRDs, istioCRDsErr = loadIstioCRDs() })
	if istioCRDsErr != nil {
		return nil, istioCRDsErr
	}
	crd, ok := istioCRDs[name]
	if !ok {
		return nil, fmt.Errorf("no CRD %s in istio.io/api's %s", name, istioCRDFile)
	}
	return crd, nil
}

func loadIstioCRDs() (map[string]*unstructured.Unstructured, error) {
	dir, err := moduleDir("istio.io/api")
	if err != nil {
		return nil, err
	}
	list, err := readCRDs(filepath.Join(dir, istioCRDFile))
	if err != nil {
		return nil, err
	}
	crds := map[string]*unstructured.Unstructured{}
	for _, u := range list {
		crds[u.GetName()] = u
	}
	return crds, nil
}

// readCRDs returns the CustomResourceDefinitions of a multi-document YAML
// file, in file order.
func readCRDs(path string) ([]*unstructured.Unstructured, error) {
	objs, err := readObjects(path)
	if err != nil {
		return nil, fmt.Errorf("read CRDs: %w", err)
	}
	var crds []*unstructured.Unstructured
	for _, u := range objs {
		if u.GetKind() == "CustomResourceDefinition" {
			crds = append(crds, u)
		}
	}
	return crds, nil
}

// readObjects reads every object of a YAML (or JSON) file.
func readObjects(path string) ([]*unstructured.Unstructured, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var objs []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, fmt.Errorf("decode %s: %w", path, err)
		}
		if obj != nil {
			objs = append(objs, &unstructured.Unstructured{Object: obj})
		}
	}
	return objs, nil
}

// moduleDir returns the directory of module path (at the version the main go.mod
// requires) in the module cache, downloading it if needed.
func moduleDir(path string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command("go", "mod", "download", "-json", path)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go mod download %s: %v: %s", path, err, stderr.String())
	}
	var info struct{ Dir, Version, Error string }
	if err := json.Unmarshal(out, &info); err != nil {
		return "", fmt.Errorf("go mod download %s: %w", path, err)
	}
	if info.Error != "" || info.Dir == "" {
		return "", fmt.Errorf("go mod download %s: %s", path, info.Error)
	}
	return info.Dir, nil
}
