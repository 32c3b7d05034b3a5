package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// repoRoot is the module root, two levels above this package.
func repoRoot() string {
	_, file, _, _ := goruntime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// manifestsDir is deploy/kubernetes.
func manifestsDir() string { return filepath.Join(repoRoot(), "deploy", "kubernetes") }

// kustomize renders dir as `kubectl apply -k dir` does.
func kustomize(dir string) ([]byte, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	return m.AsYaml()
}

// kustomizeWith renders the base with components, through an overlay in tmp
// (what an operator's own kustomization would be).
func kustomizeWith(tmp string, components ...string) ([]byte, error) {
	return kustomizeOverlay(tmp, "", components...)
}

// kustomizeOverlay is kustomizeWith with more of an overlay's kustomization (YAML,
// e.g. "patches: [...]") after its components.
func kustomizeOverlay(tmp, more string, components ...string) ([]byte, error) {
	// kustomize takes only relative paths to other kustomization roots.
	rel := func(p string) (string, error) { return filepath.Rel(tmp, p) }
	base, err := rel(manifestsDir())
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	b.WriteString("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - " + base + "\ncomponents:\n")
	for _, c := range components {
		p, err := rel(filepath.Join(manifestsDir(), "components", c))
		if err != nil {
			return nil, err
		}
		b.WriteString("  - " + p + "\n")
	}
	b.WriteString(more + "\n")
	if err := os.WriteFile(filepath.Join(tmp, "kustomization.yaml"), []byte(b.String()), 0o644); err != nil {
		return nil, err
	}
	return kustomize(tmp)
}

// scheme knows the built-in kinds the manifests may hold.
func scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, rbacv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}

// object is one decoded manifest document.
type object struct {
	obj  runtime.Object // typed for built-in kinds, *unstructured.Unstructured otherwise
	kind string
	name string
}

// crdKinds may appear only as unstructured objects (their schemas live in CRDs,
// checked against the API server).
var crdKinds = map[string]bool{
	"monitoring.coreos.com/v1, Kind=ServiceMonitor": true,
	"monitoring.coreos.com/v1, Kind=PrometheusRule": true,
	// The DNSEgressPolicy CRD: the API server validates it on apply
	// (TestManifestsServerSideApply); the main module has no
	// apiextensions types.
	"apiextensions.k8s.io/v1, Kind=CustomResourceDefinition": true,
}

// decodeStrict decodes every YAML document strictly: an unknown or duplicated
// field, or a kind the API types do not have, is an error.
func decodeStrict(data []byte) ([]object, error) {
	s := scheme()
	ser := kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, s, s, kjson.SerializerOptions{Yaml: true, Strict: true})
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var out []object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(doc)) == 0 || isComment(doc) {
			continue
		}
		obj, gvk, err := ser.Decode(doc, nil, nil)
		if err != nil {
			if !runtime.IsNotRegisteredError(err) {
				return nil, err
			}
			j, err := yaml.YAMLToJSONStrict(doc)
			if err != nil {
				return nil, err
			}
			u := &unstructured.Unstructured{}
			if err := u.UnmarshalJSON(j); err != nil {
				return nil, err
			}
			if !crdKinds[u.GroupVersionKind().String()] {
				return nil, fmt.Errorf("%s %s: not a kind the manifests may use", u.GroupVersionKind(), u.GetName())
			}
			out = append(out, object{obj: u, kind: u.GetKind(), name: u.GetName()})
			continue
		}
		name := ""
		if m, ok := obj.(interface{ GetName() string }); ok {
			name = m.GetName()
		}
		out = append(out, object{obj: obj, kind: gvk.Kind, name: name})
	}
}

func isComment(doc []byte) bool {
	for _, l := range strings.Split(string(doc), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// imageArches are the architectures `make image` builds by default: the
// Makefile's IMAGE_ARCHES, sorted.
func imageArches() []string {
	b, err := os.ReadFile(filepath.Join(repoRoot(), "Makefile"))
	if err != nil {
		panic(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 3 && f[0] == "IMAGE_ARCHES" && f[1] == "?=" {
			arches := slices.Clone(f[2:])
			slices.Sort(arches)
			return arches
		}
	}
	panic("no IMAGE_ARCHES ?= line in the Makefile")
}
