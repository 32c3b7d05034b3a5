// Package ndssource is the name source of an Istio control plane: it
// connects to istiod over xDS (ADS, gRPC) and subscribes to the NameTable
// (NDS, type istio.networking.nds.v1.NameTable) the way the Istio agent
// does, so the resolver answers exactly the names and addresses istiod
// computed for a sidecar: ServiceEntry VIP auto-allocation, exportTo and
// Sidecar scoping, multicluster merging, headless pod names.
//
// istiod computes a table per proxy. One node agent stands in for the
// sidecars of a node with one view per namespace: an ADS stream per
// namespace, each as a proxy of that namespace with DNS capture and VIP
// auto-allocation on. A host a view receives is visible to the clients of
// that namespace; a host every view received alike is visible to every
// client (also those whose namespace is unknown). The agent's own
// namespace always has a view; in node mode the namespaces of this node's
// Pods (from the Kubernetes source) add theirs. docs/istio.md has the
// details.
//
// NDS is one resource: every push carries the whole table. The source
// compares it with what the view had and hands the name store only the
// names that changed. While istiod is unreachable the last tables keep
// serving; streams reconnect with backoff, and the first table after a
// reconnect again changes only what changed.
package ndssource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	nds "istio.io/istio/pkg/dns/proto"

	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// NameTableType is the xDS type URL of Istio's name table.
const NameTableType = "type.googleapis.com/istio.networking.nds.v1.NameTable"

// DefaultClusterID is the cluster ID Istio gives a cluster when none is
// configured.
const DefaultClusterID = "Kubernetes"

// Config configures an NDS source.
type Config struct {
	// Name of the source in the store (default "istiod").
	Name string
	// Addr is istiod's xDS address, HOST:PORT (15010 plaintext, 15012 TLS).
	Addr string
	// CAFile, when set, is the CA that signed istiod's serving certificate
	// (Istio's root-cert.pem): the connection uses TLS. Without it the
	// connection is plaintext.
	CAFile string
	// TokenFile, when set, holds a Kubernetes service account token that
	// is sent as a bearer token on each stream (istiod validates it with a
	// TokenReview; Istio projects it with audience istio-ca). It is read
	// again on every connect, so a rotated token is picked up. TLS only.
	TokenFile string
	// SAN is the name istiod's certificate must carry (default: the host
	// of Addr).
	SAN string
	// ClusterID is the proxy's cluster (default DefaultClusterID).
	ClusterID string
	// Domain is the cluster domain ("cluster.local").
	Domain string
	// ProxyName is the pod-name part of the proxies' IDs; the view of
	// namespace NS is the proxy "ProxyName.NS" (istiod's
	// /debug/ndsz?proxyID=ProxyName.NS).
	ProxyName string
	// ProxyIPs are the proxies' IP addresses; istiod gives the addresses
	// of the families they cover.
	ProxyIPs []netip.Addr
	// Namespace is the agent's own namespace: its view always exists.
	Namespace string
	// Namespaces, in node mode, lists the namespaces that need a view (the
	// namespaces of this node's Pods); nil: only Namespace's view.
	Namespaces func() []string
	// Poll is how often Namespaces is read (default one second).
	Poll time.Duration
	// Backoff bounds the reconnect delay (default 100 ms doubling to 5 s).
	MinBackoff, MaxBackoff time.Duration
	Logger                 *slog.Logger
	// Metrics, when set, receives the source's metrics (NewMetrics).
	Metrics *Metrics
}

// Source is istiod's NDS as a name source.
type Source struct {
	cfg    Config
	domain string
	log    *slog.Logger

	mu     sync.Mutex // guards views for Views
	status map[string]ViewStatus
}

// New validates cfg. It contacts nothing.
func New(cfg Config) (*Source, error) {
	if cfg.Name == "" {
		cfg.Name = "istiod"
	}
	if cfg.Addr == "" {
		return nil, errors.New("istiod source: no address")
	}
	host, _, err := splitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("--istiod %q: %w", cfg.Addr, err)
	}
	if cfg.SAN == "" {
		cfg.SAN = host
	}
	if cfg.TokenFile != "" && cfg.CAFile == "" {
		return nil, errors.New("--istiod-token-file needs TLS: give --istiod-ca-file (a token is never sent in plaintext)")
	}
	for _, f := range []string{cfg.CAFile, cfg.TokenFile} {
		if f == "" {
			continue
		}
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("istiod source: %w", err)
		}
	}
	if cfg.Namespace == "" {
		return nil, errors.New("istiod source: no namespace for the agent's own view (give --namespace)")
	}
	if cfg.ClusterID == "" {
		cfg.ClusterID = DefaultClusterID
	}
	if cfg.ProxyName == "" {
		h, _ := os.Hostname()
		cfg.ProxyName = "meshdns-ebpf-" + strings.ToLower(h)
	}
	if cfg.Poll <= 0 {
		cfg.Poll = time.Second
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 100 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(5*time.Second, cfg.MinBackoff)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	domain := strings.ToLower(strings.Trim(cfg.Domain, "."))
	if domain == "" {
		domain = nametable.DefaultClusterDomain
	}
	return &Source{cfg: cfg, domain: domain, log: cfg.Logger.With("source", cfg.Name), status: map[string]ViewStatus{}}, nil
}

// Name implements names.Source.
func (s *Source) Name() string { return s.cfg.Name }

// ProxyID is the proxy ID of the view of namespace ns, as istiod's debug
// endpoints take it (?proxyID=).
func (s *Source) ProxyID(ns string) string { return s.cfg.ProxyName + "." + ns }

// ViewStatus is one view's state.
type ViewStatus struct {
	Namespace string    `json:"namespace"`
	Connected bool      `json:"connected"`
	Names     int       `json:"names"`
	Pushes    uint64    `json:"pushes"`
	LastPush  time.Time `json:"lastPush,omitzero"`
	LastError string    `json:"lastError,omitempty"`
}

// Views lists the views by namespace.
func (s *Source) Views() []ViewStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]ViewStatus, 0, len(s.status))
	for _, v := range s.status {
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b ViewStatus) int { return strings.Compare(a.Namespace, b.Namespace) })
	return out
}

// StatusDetail implements the store's optional detail for `status`.
func (s *Source) StatusDetail() string {
	views := s.Views()
	conn := 0
	for _, v := range views {
		if v.Connected {
			conn++
		}
	}
	return fmt.Sprintf("istiod %s: %d/%d views connected", s.cfg.Addr, conn, len(views))
}

func (s *Source) setStatus(ns string, f func(*ViewStatus)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.status[ns]
	if !ok {
		v = ViewStatus{Namespace: ns}
	}
	f(&v)
	s.status[ns] = v
}

func (s *Source) dropStatus(ns string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.status, ns)
}

// Run implements names.Source: it keeps one stream per view, applies each
// table a view receives to sink, marks the source synced once the views
// it started with have each received a table (or failed once; the
// agent's own view must have a table), and reports istiod's reachability
// through sink.Failed.
func (s *Source) Run(ctx context.Context, sink names.Sink) error {
	conn, err := s.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	m := newMerger(sink, s.domain, s.log)
	events := make(chan event)
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel: the streams end with ctx
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A view's stream; gen tells its events from those of an earlier
	// stream of the same namespace (a view dropped and added again).
	type stream struct {
		stop context.CancelFunc
		gen  int
	}
	streams := map[string]stream{}
	gen := 0
	failing := map[string]error{}
	synced := false
	reconcile := func() {
		want := s.wanted()
		for ns, st := range streams {
			if !slices.Contains(want, ns) {
				st.stop()
				delete(streams, ns)
				delete(failing, ns)
				s.dropStatus(ns)
				s.cfg.Metrics.dropped(ns)
				m.drop(ns)
			}
		}
		for _, ns := range want {
			if _, ok := streams[ns]; ok {
				continue
			}
			sctx, stop := context.WithCancel(ctx)
			gen++
			streams[ns] = stream{stop, gen}
			m.want(ns)
			s.setStatus(ns, func(*ViewStatus) {})
			wg.Add(1)
			g := gen
			go func() { defer wg.Done(); s.stream(sctx, conn, ns, g, events) }()
		}
	}
	reconcile()
	var tick <-chan time.Time
	if s.cfg.Namespaces != nil {
		t := time.NewTicker(s.cfg.Poll)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick:
			reconcile()
		case ev := <-events:
			if st, live := streams[ev.ns]; !live || st.gen != ev.gen {
				continue // a stream stopped on purpose
			}
			s.viewEvent(ev)
			if ev.table != nil {
				delete(failing, ev.ns)
				m.apply(ev.ns, ev.table)
			} else {
				failing[ev.ns] = ev.err
				m.tried(ev.ns)
			}
			s.report(sink, failing)
			if !synced && m.initialDone(s.cfg.Namespace) {
				synced = true
				// The store's count of names against the merger's, as the
				// other sources audit theirs; one goroutine feeds the store,
				// so a mismatch is a bug, and the names are set again.
				for i := 0; i < names.MaxAudits && sink.Audit(m.names()) != nil; i++ {
					m.recomputeAll()
				}
				sink.Synced()
				s.log.Info("istiod source synced", "views", len(streams), "names", m.names())
			}
		}
	}
}

// viewEvent records a view's push or failure in its status and metrics.
func (s *Source) viewEvent(ev event) {
	if ev.table == nil {
		s.setStatus(ev.ns, func(v *ViewStatus) { v.Connected, v.LastError = false, ev.err.Error() })
		s.cfg.Metrics.disconnected(ev.ns)
		return
	}
	n := len(ev.table.GetTable())
	s.setStatus(ev.ns, func(v *ViewStatus) {
		v.Connected, v.LastError, v.Names, v.LastPush = true, "", n, time.Now()
		v.Pushes++
	})
	s.cfg.Metrics.pushed(ev.ns, n)
}

// wanted is the sorted set of namespaces that need a view.
func (s *Source) wanted() []string {
	want := []string{s.cfg.Namespace}
	if s.cfg.Namespaces != nil {
		for _, ns := range s.cfg.Namespaces() {
			if ns != "" && !slices.Contains(want, ns) {
				want = append(want, ns)
			}
		}
	}
	slices.Sort(want)
	return want
}

// report tells the store whether istiod is reachable: failing while any
// view's stream is down.
func (s *Source) report(sink names.Sink, failing map[string]error) {
	keys := make([]string, 0, len(failing))
	for ns := range failing {
		keys = append(keys, ns)
	}
	if len(keys) == 0 {
		sink.Failed(nil)
		return
	}
	slices.Sort(keys)
	sink.Failed(fmt.Errorf("view %s: %w", keys[0], failing[keys[0]]))
}

// event is what a stream tells Run: a table received, or the stream
// failed (table nil).
type event struct {
	ns    string
	gen   int
	table *nds.NameTable
	err   error
}
