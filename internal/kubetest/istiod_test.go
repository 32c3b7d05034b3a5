package kubetest

import (
	"path/filepath"
	"testing"
)

// The istiod the tests run and the NameTable type the agent decodes come
// from the same istio.io/istio version.
func TestIstioVersionMatchesModules(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, gomod := range []string{filepath.Join(root, "tools", "istiod", "go.mod"), filepath.Join(root, "go.mod")} {
		if got := requiredVersion(t, gomod, "istio.io/istio"); got != IstioVersion {
			t.Errorf("%s requires istio.io/istio %s, kubetest.IstioVersion is %s: bump them together", gomod, got, IstioVersion)
		}
	}
}
