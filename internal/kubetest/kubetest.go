// Package kubetest runs a real Kubernetes control plane for the tests of other
// packages: etcd, kube-apiserver and, optionally, kube-controller-manager with the
// EndpointSlice controllers, all on 127.0.0.1 with ports, data and certificates of
// the test's own. The binaries are the real ones, built from Go modules by
// scripts/build-kube.sh (`make kube-bin`, which `make test` runs) into
// .cache/kube-bin/<version> or $MESHDNS_KUBE_BIN. When they are missing a test
// skips, or fails under CI=true (internal/testenv's gate).
//
// No kubelet runs. Pods are API objects whose status a test sets (phase, IPs, the
// Ready condition) through the status subresource; the real EndpointSlice controller
// turns them into EndpointSlices. Every child process dies with the test binary
// (Pdeathsig) and is killed and waited for in t.Cleanup; its log tail is printed when
// the test failed. Only tests import this package; the agent binary never does.
package kubetest

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// KubeVersion is the Kubernetes release the control plane runs; tools/kube/go.mod
// requires the same (a test checks).
const KubeVersion = "v1.37.2"

// Admin is the user name of the system:masters identity every ControlPlane has;
// pass it to Kubeconfig or RESTConfig for cluster-admin credentials.
const Admin = "kubetest-admin"

// ServiceCIDRs are the dual-stack Service ranges of every API server (IPv4 first).
const ServiceCIDRs = "10.96.0.0/16,fd00:10:96::/112"

// mainModule is the module path of the main go.mod, to find the repository root.
const mainModule = "github.com/meshdns/meshdns-ebpf"

// Readiness limits: generous, because CI machines are busy and the first start reads
// a 100 MB binary from a cold page cache. Readiness is polled, so a fast start is
// not slowed down by them.
const (
	etcdTimeout      = 30 * time.Second
	apiserverTimeout = 90 * time.Second
	kcmTimeout       = 90 * time.Second
)

// Options configure Start.
type Options struct {
	// ControllerManager also runs kube-controller-manager with the endpointslice,
	// endpointslicemirroring, garbagecollector and clusterrole-aggregation
	// controllers (nothing that needs a kubelet), so Pods whose status a test sets
	// become EndpointSlices, objects owned by a deleted one (a Service's slices) are
	// collected, and the aggregated ClusterRoles view/edit/admin have rules.
	ControllerManager bool
	// Users are plain users in the static token file: no groups, so RBAC grants them
	// nothing until a test binds them (BindClusterRole).
	Users []string
	// ShareEtcd runs this API server on the etcd of another ControlPlane under its
	// own --etcd-prefix: a second, isolated cluster for multicluster tests at the
	// cost of one process less. Nil starts an etcd of its own.
	ShareEtcd *ControlPlane
	// APIServerArgs are extra kube-apiserver flags, appended after kubetest's own
	// (a later flag wins).
	APIServerArgs []string

	// The fields below place the control plane elsewhere than the test's own
	// network namespace (internal/nodetest runs a whole node in namespaces of its
	// own); all are optional.

	// Wrap is put before every process's command line, e.g. nsenter into the
	// node's mount and network namespaces.
	Wrap []string
	// Cgroup is a cgroup2 directory every process starts in (CLONE_INTO_CGROUP).
	Cgroup string
	// Address is where kube-apiserver binds and what it advertises (default
	// 127.0.0.1); its serving certificate names it.
	Address string
	// Dial makes the test's own connections to the processes (readiness checks,
	// clients); nil dials from the test's network namespace.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// ServiceAccounts keeps the ServiceAccount admission plugin on, so a pod that
	// a real kubelet runs gets its token mounted (needs the serviceaccount
	// controller in Controllers for each namespace's "default" account).
	ServiceAccounts bool
	// Controllers replaces the controller-manager's controller list.
	Controllers string
	// ControllerManagerArgs are extra kube-controller-manager flags.
	ControllerManagerArgs []string
}

// Timings are the measured startup costs of one Start.
type Timings struct {
	Etcd              time.Duration // etcd start to /health OK (0 when shared)
	APIServer         time.Duration // kube-apiserver start to /readyz OK and default namespace present
	ControllerManager time.Duration // kube-controller-manager start to its first EndpointSlice (0 when off)
	Total             time.Duration // Start's whole cost, including key generation
}

func (tm Timings) String() string {
	return fmt.Sprintf("total %v (etcd %v, kube-apiserver %v, kube-controller-manager %v)",
		tm.Total.Round(time.Millisecond), tm.Etcd.Round(time.Millisecond),
		tm.APIServer.Round(time.Millisecond), tm.ControllerManager.Round(time.Millisecond))
}

// ControlPlane is one running cluster's control plane.
type ControlPlane struct {
	Timings Timings

	bin        string
	dir        string
	opts       Options
	pki        *pki
	etcd       *process // nil when the etcd is shared
	etcdURL    string
	etcdPrefix string
	apiserver  *process
	apiArgs    []string
	port       int
	kcm        *process

	client   kubernetes.Interface
	dynamic  dynamic.Interface
	readyzOK func() error
}

// Start runs a control plane for the test and stops it at cleanup. It skips the
// test (fails it under CI=true) when the binaries are not built.
func Start(t testing.TB, opts Options) *ControlPlane {
	t.Helper()
	begin := time.Now()
	bin := binDir(t)
	if opts.Address == "" {
		opts.Address = "127.0.0.1"
	}
	cp := &ControlPlane{bin: bin, dir: t.TempDir(), opts: opts}
	var err error
	if cp.pki, err = newPKI(cp.dir, opts.Users, net.ParseIP(opts.Address)); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	t.Cleanup(func() { cp.stopAll(t) })

	if opts.ShareEtcd != nil {
		cp.etcdURL = opts.ShareEtcd.etcdURL
		cp.etcdPrefix = "/kubetest-" + testenv.RandSuffix(8)
	} else {
		cp.startEtcd(t)
		cp.etcdPrefix = "/registry"
	}
	cp.startAPIServerFirst(t, opts.APIServerArgs)
	if opts.ControllerManager {
		cp.startControllerManager(t)
	}
	cp.Timings.Total = time.Since(begin)
	t.Logf("kubetest: control plane %s up: %v", cp.Host(), cp.Timings)
	return cp
}

// binDir finds the built binaries: $MESHDNS_KUBE_BIN, else the repository's
// .cache/kube-bin/<KubeVersion>. It skips (fails under CI) when one is missing.
func binDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("MESHDNS_KUBE_BIN")
	if dir == "" {
		root, err := RepoRoot()
		if err != nil {
			testenv.Skip(t, "kubetest: %v; set MESHDNS_KUBE_BIN to the directory `make kube-bin` built", err)
		}
		dir = filepath.Join(root, ".cache", "kube-bin", KubeVersion)
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-controller-manager"} {
		st, err := os.Stat(filepath.Join(dir, b))
		if err != nil || st.Mode()&0o111 == 0 {
			testenv.Skip(t, "kubetest: %s is not built in %s: run `make kube-bin` (scripts/build-kube.sh)", b, dir)
		}
	}
	return dir
}

// RepoRoot walks up from the working directory (a test runs in its package's
// directory) to the directory of the main module's go.mod.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("working directory: %w", err)
	}
	for d := dir; ; d = filepath.Dir(d) {
		if modulePath(filepath.Join(d, "go.mod")) == mainModule {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no go.mod of %s above %s", mainModule, dir)
		}
	}
}

// modulePath returns the module line of a go.mod file, "" when unreadable.
func modulePath(gomod string) string {
	f, err := os.Open(gomod)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(sc.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`)
		}
	}
	return ""
}

func (cp *ControlPlane) newProcess(name string) *process {
	return &process{name: name, path: filepath.Join(cp.bin, name), logPath: filepath.Join(cp.dir, name+".log"),
		wrap: cp.opts.Wrap, cgroup: cp.opts.Cgroup}
}

// httpClient is a client for the readiness checks, dialling with Options.Dial.
func (cp *ControlPlane) httpClient(tlsConfig *tls.Config) *http.Client {
	tr := &http.Transport{TLSClientConfig: tlsConfig, DialContext: cp.opts.Dial}
	return &http.Client{Timeout: 2 * time.Second, Transport: tr}
}

func (cp *ControlPlane) startEtcd(t testing.TB) {
	t.Helper()
	cp.etcd = cp.newProcess("etcd")
	data := filepath.Join(cp.dir, "etcd-data")
	httpc := cp.httpClient(nil)
	ports, took := cp.etcd.startRetrying(t, 2, etcdTimeout,
		func(p []int) []string {
			client, peer := "http://127.0.0.1:"+strconv.Itoa(p[0]), "http://127.0.0.1:"+strconv.Itoa(p[1])
			return []string{
				"--name", "kubetest",
				"--data-dir", data,
				"--listen-client-urls", client, "--advertise-client-urls", client,
				"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
				"--initial-cluster", "kubetest=" + peer,
				"--unsafe-no-fsync",
				"--log-level", "warn",
			}
		},
		func(p []int) error {
			return httpOK(httpc, "http://127.0.0.1:"+strconv.Itoa(p[0])+"/health", "", `"health":"true"`)
		})
	cp.etcdURL = "http://127.0.0.1:" + strconv.Itoa(ports[0])
	cp.Timings.Etcd = took
}

// startAPIServerFirst picks the API server's port and starts it the first time;
// StartAPIServer restarts it on the same port with the same arguments.
func (cp *ControlPlane) startAPIServerFirst(t testing.TB, extra []string) {
	t.Helper()
	cp.apiserver = cp.newProcess("kube-apiserver")
	certDir := filepath.Join(cp.dir, "apiserver-certs")
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(cp.pki.caPEM)
	httpc := cp.httpClient(&tls.Config{RootCAs: pool})
	disabled := []string{"--disable-admission-plugins", "ServiceAccount"}
	if cp.opts.ServiceAccounts {
		disabled = nil
	}
	args := func(p []int) []string {
		a := []string{
			"--etcd-servers", cp.etcdURL,
			"--etcd-prefix", cp.etcdPrefix,
			"--bind-address", cp.opts.Address,
			"--advertise-address", cp.opts.Address,
			"--secure-port", strconv.Itoa(p[0]),
			"--cert-dir", certDir,
			"--tls-cert-file", cp.pki.certFile,
			"--tls-private-key-file", cp.pki.keyFile,
			"--service-cluster-ip-range", ServiceCIDRs,
			"--endpoint-reconciler-type", "none",
			"--authorization-mode", "RBAC",
			"--token-auth-file", cp.pki.tokenFile,
			"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
			"--service-account-key-file", cp.pki.saPubFile,
			"--service-account-signing-key-file", cp.pki.saKeyFile,
			// As kubeadm clusters: manifests that ask for privileges are judged by
			// tests, not refused by the server.
			"--allow-privileged=true",
		}
		// Pods here are API objects only: no kubelet mounts a token, so the
		// admission plugin that requires each namespace's "default"
		// ServiceAccount (made by a controller not run here) is off, unless
		// Options.ServiceAccounts.
		return append(append(a, disabled...), extra...)
	}
	ports, _ := cp.apiserver.startRetrying(t, 1, apiserverTimeout, args, func(p []int) error {
		return httpOK(httpc, "https://"+net.JoinHostPort(cp.opts.Address, strconv.Itoa(p[0]))+"/readyz", cp.pki.adminToken, "ok")
	})
	cp.port = ports[0]
	cp.apiArgs = args(ports)
	cp.readyzOK = func() error { return httpOK(httpc, cp.Host()+"/readyz", cp.pki.adminToken, "ok") }
	admin := cp.RESTConfig(t, Admin)
	var err error
	if cp.client, err = kubernetes.NewForConfig(admin); err != nil {
		t.Fatalf("kubetest: admin client: %v", err)
	}
	if cp.dynamic, err = dynamic.NewForConfig(admin); err != nil {
		t.Fatalf("kubetest: dynamic client: %v", err)
	}
	cp.Timings.APIServer = cp.waitBootstrapped(t)
}

// waitBootstrapped waits until the API server is ready and has made the default
// namespace (its bootstrap controller does that after /readyz may already say ok).
// It returns the time since the current kube-apiserver process started.
func (cp *ControlPlane) waitBootstrapped(t testing.TB) time.Duration {
	t.Helper()
	_, err := cp.apiserver.waitReady(apiserverTimeout, func() error {
		if err := cp.readyzOK(); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := cp.client.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	return cp.apiserver.sinceStart()
}

// kcmControllers are the controllers kube-controller-manager runs: Pods to
// EndpointSlices, selector-less Services' Endpoints mirrored to EndpointSlices, the
// garbage collector that deletes a deleted Service's slices, and the aggregation
// that fills the aggregated ClusterRoles (view, edit, admin; empty without it).
// None needs a kubelet.
const kcmControllers = "endpointslice,endpointslicemirroring,garbagecollector,clusterrole-aggregation"

// startControllerManager runs kube-controller-manager and waits until its
// EndpointSlice controller has made the slice of a probe Service.
func (cp *ControlPlane) startControllerManager(t testing.TB) {
	t.Helper()
	cp.kcm = cp.newProcess("kube-controller-manager")
	kubeconfig := cp.writeKubeconfig(t, filepath.Join(cp.dir, "kcm.kubeconfig"), cp.pki.kcmUserName, cp.pki.kcmToken)
	const ns, probe = "kube-system", "kubetest-kcm-probe"
	cp.EnsureNamespace(t, ns)
	cp.CreateService(t, Service{Namespace: ns, Name: probe, Selector: map[string]string{"kubetest-probe": "none"}})
	controllers := kcmControllers
	if cp.opts.Controllers != "" {
		controllers = cp.opts.Controllers
	}
	_, took := cp.kcm.startRetrying(t, 1, kcmTimeout,
		func(p []int) []string {
			return append([]string{
				"--kubeconfig", kubeconfig,
				"--controllers", controllers,
				"--leader-elect=false",
				"--use-service-account-credentials=false",
				"--bind-address", "127.0.0.1",
				"--secure-port", strconv.Itoa(p[0]),
				"--cert-dir", filepath.Join(cp.dir, "kcm-certs"),
				// What the root-ca-cert-publisher controller puts in every
				// namespace's kube-root-ca.crt (when it runs).
				"--root-ca-file", filepath.Join(cp.dir, "ca.crt"),
			}, cp.opts.ControllerManagerArgs...)
		},
		func([]int) error {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			slices, err := cp.EndpointSlices(ctx, ns, probe)
			if err == nil && len(slices) == 0 {
				err = fmt.Errorf("no EndpointSlice for the probe Service %s/%s yet", ns, probe)
			}
			return err
		})
	cp.Timings.ControllerManager = took
	// Tests start from a clean cluster: the probe and its slice (deleted by the
	// garbage collector) are gone when Start returns.
	cp.DeleteService(t, ns, probe)
	cp.WaitEndpointSlices(t, ns, probe, func(s []discoveryv1.EndpointSlice) bool { return len(s) == 0 })
}

// StopAPIServer kills kube-apiserver (SIGKILL, as a crash) and waits for it to exit;
// etcd and the controller-manager keep running.
func (cp *ControlPlane) StopAPIServer() { cp.apiserver.stop() }

// StartAPIServer starts kube-apiserver again on the same port with the same etcd,
// certificates and tokens after StopAPIServer, waits until it is ready, and returns
// how long that took.
func (cp *ControlPlane) StartAPIServer(t testing.TB) time.Duration {
	t.Helper()
	if err := cp.apiserver.start(cp.apiArgs); err != nil {
		t.Fatalf("kubetest: %v", err)
	}
	return cp.waitBootstrapped(t)
}

// stopAll stops every process (controller-manager, API server, etcd: dependents
// first) and prints their log tails when the test failed.
func (cp *ControlPlane) stopAll(t testing.TB) {
	procs := []*process{cp.kcm, cp.apiserver, cp.etcd}
	for _, p := range procs {
		if p != nil {
			p.stop()
		}
	}
	if !t.Failed() {
		return
	}
	for _, p := range procs {
		if p != nil {
			t.Logf("kubetest: last lines of %s (%s):\n%s", p.name, p.logPath, p.tail(40))
		}
	}
}

// Host is the API server's URL, https://127.0.0.1:PORT (or Options.Address).
func (cp *ControlPlane) Host() string {
	return "https://" + net.JoinHostPort(cp.opts.Address, strconv.Itoa(cp.port))
}

// Port is the API server's port.
func (cp *ControlPlane) Port() int { return cp.port }

// Dir is the directory of the control plane's files: logs, certificates, the CA
// (ca.crt) and the service-account keys.
func (cp *ControlPlane) Dir() string { return cp.dir }

// CAData is the PEM certificate of the CA that signed the API server's certificate.
func (cp *ControlPlane) CAData() []byte { return cp.pki.caPEM }

// AdminClient is a clientset with cluster-admin (system:masters) credentials and no
// client-side rate limit.
func (cp *ControlPlane) AdminClient() kubernetes.Interface { return cp.client }

// DynamicClient is a dynamic client with cluster-admin credentials (custom
// resources such as ServiceEntries).
func (cp *ControlPlane) DynamicClient() dynamic.Interface { return cp.dynamic }

// httpOK GETs url (with a bearer token when not empty) and wants 200 and a body
// containing want.
func httpOK(c *http.Client, url, token, want string) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body := make([]byte, 4096)
	n, _ := resp.Body.Read(body)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body[:n]), want) {
		return fmt.Errorf("GET %s: %s: %.300s", url, resp.Status, body[:n])
	}
	return nil
}
