package kubetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"google.golang.org/protobuf/encoding/protojson"
	nds "istio.io/istio/pkg/dns/proto"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// IstioVersion is the istio.io/istio version pilot-discovery is built from;
// tools/istiod/go.mod requires the same (a test checks).
const IstioVersion = "v0.0.0-20260827124520-eed52ebb66ad"

// IstioNamespace is where istiod runs and keeps its CA.
const IstioNamespace = "istio-system"

// IstiodSAN is the name in istiod's serving certificate (its Service's).
const IstiodSAN = "istiod.istio-system.svc"

// istiodTimeout bounds istiod's start: it answers /ready only once its
// informers have synced and its CA is up (docs/testing.md has the times seen).
const istiodTimeout = 3 * time.Minute

// Istiod is a real istiod (pilot-discovery) running against a ControlPlane.
type Istiod struct {
	// GRPCAddr is the plaintext xDS address (Istio's 15010).
	GRPCAddr string
	// SecureGRPCAddr is the TLS xDS address (15012): istiod's certificate for
	// IstiodSAN, signed by its own CA (RootCert), and bearer-token auth.
	SecureGRPCAddr string
	// HTTPAddr serves /ready and the debug endpoints (8080).
	HTTPAddr string
	// Ready is how long the first start took to /ready.
	Ready time.Duration

	cp   *ControlPlane
	proc *process
	args []string
	http *http.Client
}

// IstiodOptions configure StartIstiod.
type IstiodOptions struct {
	// Env adds environment variables (Istio's feature flags, NAME=VALUE).
	Env []string
}

// istiodBin finds pilot-discovery: $MESHDNS_ISTIOD_BIN, else the repository's
// .cache/istiod-bin/<IstioVersion>. It skips (fails under CI) when missing.
func istiodBin(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("MESHDNS_ISTIOD_BIN")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			testenv.Skip(t, "kubetest: %v; set MESHDNS_ISTIOD_BIN to the directory `make istiod-bin` built", err)
		}
		dir = filepath.Join(root, ".cache", "istiod-bin", IstioVersion)
	}
	for _, f := range []string{"pilot-discovery", "crd-all.gen.yaml"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			testenv.Skip(t, "kubetest: %s is not built in %s: run `make istiod-bin` (scripts/build-istiod.sh)", f, dir)
		}
	}
	return dir
}

// StartIstiod installs Istio's CRDs (all of them, from the istio.io/istio module
// pilot-discovery is built from) and the istio-system namespace, runs istiod
// against cp with its admin credentials, and waits for /ready. It is stopped at
// the test's cleanup (before the control plane), and its log tail is printed
// when the test failed.
func (cp *ControlPlane) StartIstiod(t testing.TB, opts IstiodOptions) *Istiod {
	t.Helper()
	dir := istiodBin(t)
	cp.InstallIstioCRDs(t, filepath.Join(dir, "crd-all.gen.yaml"))
	cp.EnsureNamespace(t, IstioNamespace)
	kubeconfig := cp.Kubeconfig(t, Admin)
	work := t.TempDir()
	mesh := filepath.Join(work, "mesh.yaml")
	// Istio's defaults, with the root namespace where the config lives.
	if err := os.WriteFile(mesh, []byte("rootNamespace: "+IstioNamespace+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	is := &Istiod{cp: cp, http: &http.Client{Timeout: 5 * time.Second}}
	is.proc = &process{name: "istiod", path: filepath.Join(dir, "pilot-discovery"), logPath: filepath.Join(work, "istiod.log")}
	is.proc.env = append([]string{
		"POD_NAMESPACE=" + IstioNamespace,
		"POD_NAME=istiod-kubetest",
		"CLUSTER_ID=Kubernetes",
		"PILOT_ENABLE_ANALYSIS=false",
		"VALIDATION_WEBHOOK_CONFIG_NAME=",
		"INJECTION_WEBHOOK_CONFIG_NAME=",
		"ISTIOD_CUSTOM_HOST=" + IstiodSAN,
	}, opts.Env...)
	t.Cleanup(func() {
		is.proc.stop()
		if t.Failed() {
			t.Logf("kubetest: last lines of istiod (%s):\n%s", is.proc.logPath, is.proc.tail(40))
		}
	})
	args := func(p []int) []string {
		a := func(i int) string { return "127.0.0.1:" + strconv.Itoa(p[i]) }
		return []string{"discovery",
			"--kubeconfig", kubeconfig,
			"--meshConfig", mesh,
			"--httpAddr", a(0), "--grpcAddr", a(1), "--secureGRPCAddr", a(2),
			"--monitoringAddr", a(3), "--httpsAddr", a(4), "--ctrlz_address", "127.0.0.1", "--ctrlz_port", strconv.Itoa(p[5]),
			"--domain", "cluster.local",
			"--log_output_level", "default:info",
		}
	}
	ports, took := is.proc.startRetrying(t, 6, istiodTimeout, args, func(p []int) error {
		return is.readyAt("127.0.0.1:" + strconv.Itoa(p[0]))
	})
	is.args = args(ports)
	is.HTTPAddr = "127.0.0.1:" + strconv.Itoa(ports[0])
	is.GRPCAddr = "127.0.0.1:" + strconv.Itoa(ports[1])
	is.SecureGRPCAddr = "127.0.0.1:" + strconv.Itoa(ports[2])
	is.Ready = took
	t.Logf("kubetest: istiod up in %v (xDS %s, TLS xDS %s, http %s)", took.Round(time.Millisecond), is.GRPCAddr, is.SecureGRPCAddr, is.HTTPAddr)
	return is
}

func (is *Istiod) readyAt(addr string) error {
	resp, err := is.http.Get("http://" + addr + "/ready")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("istiod /ready: %s", resp.Status)
	}
	return nil
}

// PID is the running istiod's process id (0 when stopped).
func (is *Istiod) PID() int { return is.proc.pid() }

// Stop kills istiod (SIGKILL, as a crash) and waits for it to exit.
func (is *Istiod) Stop() { is.proc.stop() }

// Start starts istiod again after Stop, on the same ports, and waits for /ready;
// it returns how long that took.
func (is *Istiod) Start(t testing.TB) time.Duration {
	t.Helper()
	if err := is.proc.start(is.args); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	took, err := is.proc.waitReady(istiodTimeout, func() error { return is.readyAt(is.HTTPAddr) })
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	return took
}

// RootCert is the PEM root certificate of istiod's CA (Istio's root-cert.pem),
// from the ConfigMap istio-ca-root-cert istiod writes.
func (is *Istiod) RootCert(t testing.TB) []byte {
	t.Helper()
	var pem string
	err := waitFor(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		cm, err := is.cp.client.CoreV1().ConfigMaps(IstioNamespace).Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		if err != nil {
			return err
		}
		if pem = cm.Data["root-cert.pem"]; pem == "" {
			return errors.New("istio-ca-root-cert has no root-cert.pem")
		}
		return nil
	})
	if err != nil {
		t.Fatalf("kubetest: istiod's root certificate: %v", err)
	}
	return []byte(pem)
}

// NDS is istiod's own /debug/ndsz for a connected proxy (POD.NAMESPACE): the
// NameTable it computed for that proxy, in Istio's Go type. istiod answers an
// error for a proxy that is not connected.
func (is *Istiod) NDS(proxyID string) (*nds.NameTable, error) {
	resp, err := is.http.Get("http://" + is.HTTPAddr + "/debug/ndsz?" + url.Values{"proxyID": {proxyID}}.Encode())
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("istiod /debug/ndsz?proxyID=%s: %s: %.300s", proxyID, resp.Status, body)
	}
	// An Envoy admin ConfigDump: {"configs": [{"@type": "...NameTable", "table": {...}}]}.
	var dump struct {
		Configs []map[string]json.RawMessage `json:"configs"`
	}
	if err := json.Unmarshal(body, &dump); err != nil {
		return nil, fmt.Errorf("istiod /debug/ndsz: %w: %.300s", err, body)
	}
	out := &nds.NameTable{}
	for _, c := range dump.Configs {
		delete(c, "@type")
		b, _ := json.Marshal(c)
		if err := protojson.Unmarshal(b, out); err != nil {
			return nil, fmt.Errorf("istiod /debug/ndsz: %w", err)
		}
	}
	if out.Table == nil {
		out.Table = map[string]*nds.NameTable_NameInfo{}
	}
	return out, nil
}

// InstallIstioCRDs creates every CRD of file (Istio's crd-all.gen.yaml) that is
// not there yet and waits until all are Established.
func (cp *ControlPlane) InstallIstioCRDs(t testing.TB, file string) {
	t.Helper()
	cp.InstallCRDs(t, file)
}

// InstallCRDs creates every CRD of a YAML file that is not there yet and waits
// until all are Established.
func (cp *ControlPlane) InstallCRDs(t testing.TB, file string) {
	t.Helper()
	crds, err := readCRDs(file)
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	ctx, cancel := opContext(t)
	defer cancel()
	for _, u := range crds {
		if _, err := cp.dynamic.Resource(crdGVR).Create(ctx, u, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("kubetest: create CRD %s: %v", u.GetName(), err)
		}
	}
	for _, u := range crds {
		cp.waitEstablished(t, u.GetName())
	}
}

// waitFor polls f every 20 ms until it returns nil or WaitTimeout passes.
func waitFor(f func() error) error {
	var err error
	testenv.WaitFor(WaitTimeout, func() bool { err = f(); return err == nil })
	return err
}
