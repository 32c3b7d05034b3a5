package agent

import (
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"

	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/meshsource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nameview"
)

// MeshConfig configures the mesh's name sources beyond the local
// cluster: Istio ServiceEntries and remote clusters. The flag names are a
// contract (docs/kubernetes.md, manifests).
type MeshConfig struct {
	ServiceEntries     bool   // --service-entries
	RemoteKubeconfigs  string // --remote-kubeconfigs DIR
	IstioRemoteSecrets bool   // --istio-remote-secrets
	Namespace          string // --namespace: the agent's own
}

// inClusterNamespace is where a pod finds its namespace.
const inClusterNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

func (c *Config) registerMeshFlags(fs *flag.FlagSet) {
	fs.BoolVar(&c.Mesh.ServiceEntries, "service-entries", true, "with a Kubernetes source: answer Istio ServiceEntries (networking.istio.io), watched while their CRD is installed")
	fs.StringVar(&c.Mesh.RemoteKubeconfigs, "remote-kubeconfigs", "", "directory with one kubeconfig file per remote cluster, named after the cluster, read live (a mounted Secret works): their Services are answered too")
	fs.BoolVar(&c.Mesh.IstioRemoteSecrets, "istio-remote-secrets", false, "also take remote clusters from Istio's remote secrets (label istio/multiCluster=true) in --namespace: one kubeconfig per data key, named after the key")
	fs.StringVar(&c.Mesh.Namespace, "namespace", os.Getenv("POD_NAMESPACE"), "the agent's own namespace, where --istio-remote-secrets reads Secrets (default $POD_NAMESPACE, else the in-cluster service account's)")
}

// validateMesh checks the mesh flags against the rest.
func (c *Config) validateMesh() error {
	if c.Mesh.IstioRemoteSecrets && !c.Kubernetes() {
		return fmt.Errorf("--istio-remote-secrets reads Secrets of the local cluster: give --kubeconfig or --kubernetes")
	}
	return nil
}

// meshSources reports whether a mesh source other than the local cluster
// is configured (then the demo table is not used).
func (c *Config) meshSources() bool { return c.Mesh.RemoteKubeconfigs != "" }

// addMeshSources adds the ServiceEntry source (with a Kubernetes source;
// returned, nil without) and the remote cluster discovery to the store.
func (c *Config) addMeshSources(store *names.Store, kubeRest *rest.Config, log *slog.Logger) (se *meshsource.ServiceEntries, err error) {
	log = log.With("component", "names")
	if kubeRest != nil && c.Mesh.ServiceEntries {
		if se, err = meshsource.NewServiceEntries(kubeRest, log); err != nil {
			return nil, err
		}
		// Optional: a cluster without Istio, or a role without the
		// ServiceEntry rules, must not keep the node's DNS unready.
		if err := store.Add(se, names.SourceOptions{Priority: names.PriorityServiceEntries, Optional: true}); err != nil {
			return nil, err
		}
	}
	if c.Mesh.RemoteKubeconfigs == "" && !c.Mesh.IstioRemoteSecrets {
		return se, nil
	}
	cfg := meshsource.ClustersConfig{Sources: store, Dir: c.Mesh.RemoteKubeconfigs, Domain: c.ClusterDomain, Logger: log}
	if cfg.Dir != "" {
		if fi, err := os.Stat(cfg.Dir); err != nil || !fi.IsDir() {
			return nil, fmt.Errorf("--remote-kubeconfigs %s: not a directory (%v)", cfg.Dir, err)
		}
	}
	if c.Mesh.IstioRemoteSecrets {
		ns, err := c.Mesh.ownNamespace(c.InCluster)
		if err != nil {
			return nil, fmt.Errorf("--istio-remote-secrets: %w", err)
		}
		cfg.Secrets, cfg.Namespace = kubeRest, ns
	}
	m, err := meshsource.NewClusters(cfg)
	if err != nil {
		return nil, err
	}
	return se, store.Add(m, names.SourceOptions{Priority: names.PriorityRemoteCluster, NonBlocking: true})
}

// ownNamespace is the agent's namespace: --namespace, else (in a pod)
// the in-cluster service account's.
func (m *MeshConfig) ownNamespace(inCluster bool) (string, error) {
	ns := m.Namespace
	if ns == "" && inCluster {
		b, err := os.ReadFile(inClusterNamespace)
		if err != nil {
			return "", fmt.Errorf("no --namespace or $POD_NAMESPACE, and %w", err)
		}
		ns = strings.TrimSpace(string(b))
	}
	if ns == "" {
		return "", fmt.Errorf("give --namespace (or $POD_NAMESPACE): the agent's own namespace")
	}
	return ns, nil
}

// debugHandler serves what `meshdns-ebpf table`, `status` and `stats` read
// from the running agent (docs/kubernetes.md):
//
//	/debug/table    the merged name table (nameview.Entry list); query
//	                parameters name, namespace, source, client
//	/debug/ndsz     the same in Istio's NameTable JSON, as a client of
//	                ?namespace=NS (or Istio's ?proxyID=POD.NS) sees it
//	/debug/sources  the name sources and their sync state
//	/debug/pods     the Pods of this node (UID, namespace, name)
//	/debug/egress   DNS-gated egress: the selected workloads, their policies,
//	                grants and decisions (egressctl.Status; 404 without --egress)
//	/debug/tap      the live stream of answered queries (internal/tap):
//	                newline-delimited JSON records; filter parameters
//	                namespace, pod, cgroup, suffix, qtype, rcode, answer,
//	                min-latency, unanswered
func (c *Config) debugHandler(store *names.Store, local *kubesource.Source, tapHandler http.Handler, eg *egressPart) http.Handler {
	mux := http.NewServeMux()
	table := func(w http.ResponseWriter) bool {
		if store.Table() == nil {
			http.Error(w, "name table not ready: "+fmt.Sprint(store.Ready()), http.StatusServiceUnavailable)
			return false
		}
		return true
	}
	mux.HandleFunc("GET /debug/table", func(w http.ResponseWriter, r *http.Request) {
		if !table(w) {
			return
		}
		q := r.URL.Query()
		writeJSON(w, nameview.List(store.Table(), nameview.Filter{
			Name: q.Get("name"), Namespace: q.Get("namespace"), Source: q.Get("source"), Client: q.Get("client"),
		}))
	})
	mux.HandleFunc("GET /debug/ndsz", func(w http.ResponseWriter, r *http.Request) {
		if !table(w) {
			return
		}
		ns := r.URL.Query().Get("namespace")
		if id := r.URL.Query().Get("proxyID"); ns == "" && id != "" {
			if i := strings.LastIndexByte(id, '.'); i >= 0 {
				ns = id[i+1:]
			}
		}
		writeJSON(w, nameview.NDS(store.Table(), ns))
	})
	mux.HandleFunc("GET /debug/sources", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, store.Status())
	})
	mux.Handle("GET /debug/tap", tapHandler)
	mux.HandleFunc("GET /debug/pods", func(w http.ResponseWriter, _ *http.Request) {
		pods := []kubesource.PodRef{}
		if local != nil {
			pods = append(pods, local.Pods()...)
		}
		writeJSON(w, pods)
	})
	mux.HandleFunc("GET /debug/egress", func(w http.ResponseWriter, _ *http.Request) {
		if eg == nil {
			http.Error(w, "DNS-gated egress is off (--egress)", http.StatusNotFound)
			return
		}
		writeJSON(w, eg.ctl.Status(eg.eg, eg.eg.Grants()))
	})
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}
