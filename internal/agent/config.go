// Package agent runs meshdns-ebpf on a node: it validates the configuration, picks
// the capture mode (eBPF, or iptables with conntrack zones as the fallback), puts the
// resolver's node-local address in place, starts the resolver, installs the capture
// datapath, serves /healthz, /readyz and /metrics, and takes all of it down again on
// stop — capture first, so no query is sent to a resolver that is going away.
package agent

import (
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/nodeaddr"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// Capture modes.
const (
	ModeAuto     = "auto"
	ModeEBPF     = agentstate.ModeEBPF
	ModeIptables = agentstate.ModeIptables
	ModeOff      = agentstate.ModeOff // resolver only, no capture
)

// Config is the agent's configuration; the flag names are a contract (docs,
// manifests and scripts rely on them).
type Config struct {
	Mode            string
	Cgroup          string           // "" = the cgroup2 root
	Listen          []netip.AddrPort // resolver addresses; at most one per family
	Nameservers     []netip.Addr     // nil = the nameservers of ResolvConf
	CaptureAll      bool
	CaptureLoopback bool
	ProxyUIDs       []uint32
	ProxyGIDs       []uint32
	NamesFile       string // "" = the embedded default table
	Upstreams       []netip.AddrPort
	Admin           string
	BPFFS           string
	StateDir        string
	Persist         bool
	IptablesBackend string // "", "legacy" or "nft"
	UpstreamMark    uint32
	ResolvConf      string
	TTL             time.Duration
	ClusterDomain   string
	Authoritative   bool
	PodRecords      bool
	FilterAAAA      bool // --filter-aaaa external: NODATA for AAAA of names the table does not answer

	// Kubernetes source: --kubeconfig FILE or --kubernetes (in-cluster).
	Kubeconfig        string
	InCluster         bool
	NodeName          string
	ClusterDNSService string

	// ServiceEntries and remote clusters (mesh.go).
	Mesh MeshConfig
	// Who asked: attribution, top talkers, the tap (workloads.go).
	Workloads WorkloadConfig
	Egress    EgressConfig

	// Istiod is the NDS source (--istiod and its flags).
	Istiod IstiodConfig

	authoritativeSet bool
	LinkName         string
	LogLevel         string
	LogFormat        string
	CacheBytes       int // upstream cache memory cap
	// CacheWorkloadBytes caps the cache bytes one workload's misses may hold
	// (--cache-workload-bytes; 0: a 64th of CacheBytes).
	CacheWorkloadBytes int
	MaxPending         int // queries waiting for the upstream, in total
	// Each workload's budget of queries that go upstream (--workload-qps,
	// --workload-burst, --workload-max-pending).
	WorkloadBudget resolver.BudgetLimits
	MaxTCPConns    int

	// The container's memory limit in bytes (0: none) and the share of it
	// the Go runtime's soft memory limit is set to (gc.go).
	MemoryLimit      int64
	MemoryLimitRatio float64
	memoryLimit      string

	// forceNoEBPF makes auto mode behave as if the kernel probe failed (tests).
	forceNoEBPF string
	// handoverFault injects a crash into a handover (tests): "successor" exits
	// after taking the descriptors and the datapath, before it serves;
	// "predecessor" kills itself right after sending its descriptors.
	handoverFault string
	// slowSync holds the name sources' first sync back this long (tests: a
	// slow API server).
	slowSync time.Duration
	// wedgeOn wedges the query path at the first query for this name (tests:
	// a deadlock in the resolver).
	wedgeOn string
}

// DefaultClusterDNSService is the Service pods' resolv.conf points at.
const DefaultClusterDNSService = "kube-system/kube-dns"

// DefaultListen is the node-local address every pod of the node can reach.
const DefaultListen = "169.254.20.53:53"

// RegisterFlags defines the `run` flags on fs, storing into c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.registerCaptureFlags(fs)
	c.registerResolverFlags(fs)
	c.registerKubernetesFlags(fs)
	c.registerMeshFlags(fs)
	c.registerIstiodFlags(fs)
	c.registerWorkloadFlags(fs)
	c.registerEgressFlags(fs)
	c.registerProcessFlags(fs)
}

// registerCaptureFlags defines what is captured and how.
func (c *Config) registerCaptureFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Mode, "mode", ModeAuto, "capture mode: auto (eBPF when the kernel can, else iptables), ebpf, iptables, or off (resolver only)")
	fs.StringVar(&c.Cgroup, "cgroup", "", "cgroup v2 directory whose processes are captured (default: the cgroup2 root)")
	fs.Func("listen", "resolver address(es) ADDR:PORT, one per family, comma-separated (default "+DefaultListen+")", func(s string) error {
		v, err := parseAddrPorts(s, 0)
		c.Listen = v
		return err
	})
	fs.Func("nameservers", "captured nameserver IPs, comma-separated (default: the nameservers of --resolv-conf)", func(s string) error {
		v, err := parseAddrs(s)
		c.Nameservers = v
		return err
	})
	fs.BoolVar(&c.CaptureAll, "capture-all", false, "capture every port-53 destination, not only the nameservers")
	fs.BoolVar(&c.CaptureLoopback, "capture-loopback", false, "also capture nameservers on loopback addresses (127.0.0.53, 127.0.0.11, ::1)")
	fs.Func("proxy-uid", "UIDs whose DNS is never captured (e.g. 1337 for Istio's proxy), comma-separated", func(s string) error {
		v, err := parseUints(s)
		c.ProxyUIDs = v
		return err
	})
	fs.Func("proxy-gid", "GIDs whose DNS is never captured (iptables mode), comma-separated", func(s string) error {
		v, err := parseUints(s)
		c.ProxyGIDs = v
		return err
	})
	fs.StringVar(&c.BPFFS, "bpffs", agentstate.DefaultBPFFS, "directory on a bpffs where links and maps are pinned")
	fs.BoolVar(&c.Persist, "persist", true, "keep the eBPF programs attached and pinned after a stop (inert: nothing is redirected without an agent) so the next agent adopts them without a gap; --persist=false detaches them")
	fs.Func("iptables-backend", "iptables backend of iptables mode: auto (the one the host uses), nft or legacy (needs CAP_NET_RAW)", func(s string) error {
		switch s {
		case "auto":
			c.IptablesBackend = ""
		case "nft", "legacy":
			c.IptablesBackend = s
		default:
			return fmt.Errorf("want auto, nft or legacy, got %q", s)
		}
		return nil
	})
	fs.Func("upstream-mark", "SO_MARK of the resolver's own upstream sockets, never captured (default 0x3f53)", func(s string) error {
		v, err := strconv.ParseUint(s, 0, 32)
		if err != nil || v == 0 {
			return fmt.Errorf("want a non-zero 32-bit number, got %q", s)
		}
		c.UpstreamMark = uint32(v)
		return nil
	})
	c.UpstreamMark = 0x3f53
	fs.StringVar(&c.LinkName, "link", nodeaddr.DefaultLinkName, "dummy link that carries the node-local listen address")
}

// registerResolverFlags defines the resolver's: its names, upstreams and answers.
func (c *Config) registerResolverFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.NamesFile, "names", "", "name table file, JSON or YAML, reloaded live (default: the embedded demo table)")
	fs.Func("upstream", "upstream nameservers ADDR[:PORT], comma-separated (default: the nameservers of --resolv-conf)", func(s string) error {
		v, err := parseAddrPorts(s, 53)
		c.Upstreams = v
		return err
	})
	fs.StringVar(&c.ResolvConf, "resolv-conf", "/etc/resolv.conf", "resolv.conf to read nameservers and upstreams from (read before capture starts)")
	fs.DurationVar(&c.TTL, "ttl", 30*time.Second, "TTL of answers from the name table")
	fs.StringVar(&c.ClusterDomain, "cluster-domain", "cluster.local", "Kubernetes cluster domain")
	// A boolean flag (bare --authoritative is true) that also records whether
	// it was given: its default depends on the other flags.
	fs.BoolFunc("authoritative", "answer NXDOMAIN/NODATA locally for unknown names under the cluster domain (default true with a Kubernetes source, else false)", func(s string) error {
		v, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("want true or false, got %q", s)
		}
		c.Authoritative, c.authoritativeSet = v, true
		return nil
	})
	fs.Func("pods", "pod records <a-b-c-d>.<ns>.pod.<cluster domain>: insecure (answer the address in the name, as CoreDNS's \"pods insecure\") or disabled (default insecure)", func(s string) error {
		switch s {
		case "insecure":
			c.PodRecords = true
		case "disabled":
			c.PodRecords = false
		default:
			return fmt.Errorf("want insecure or disabled, got %q", s)
		}
		return nil
	})
	c.PodRecords = true
	fs.Func("filter-aaaa", "external: AAAA queries of names the name table does not answer get NODATA at once instead of going upstream (IPv4-only clusters; counted in meshdns_dns_aaaa_filtered_total), or off (default off)", func(s string) error {
		switch s {
		case "external":
			c.FilterAAAA = true
		case "off":
			c.FilterAAAA = false
		default:
			return fmt.Errorf("want external or off, got %q", s)
		}
		return nil
	})
	fs.IntVar(&c.CacheBytes, "cache-bytes", upstream.DefaultCacheBytes, "memory cap of the upstream answer cache, in bytes")
	fs.IntVar(&c.CacheWorkloadBytes, "cache-workload-bytes", 0, "the bytes of the upstream cache one workload's misses may hold; over it its own oldest answers are evicted (0: a 64th of --cache-bytes)")
	fs.IntVar(&c.MaxPending, "max-pending", resolver.DefaultMaxPending, "queries waiting for the upstream at once; over it: SERVFAIL at once")
	fs.Float64Var(&c.WorkloadBudget.QPS, "workload-qps", 0, "queries a second each workload (pod, or cgroup) may send upstream; over it REFUSED at once (0: no limit)")
	fs.IntVar(&c.WorkloadBudget.Burst, "workload-burst", 0, "upstream queries a workload may send at once within --workload-qps (default: one second's worth)")
	fs.IntVar(&c.WorkloadBudget.InFlight, "workload-max-pending", 0, "queries each workload may have waiting for the upstream; over it REFUSED at once (0: no limit)")
	fs.IntVar(&c.MaxTCPConns, "max-tcp-conns", resolver.DefaultMaxTCPConns, "open TCP client connections; at the bound the longest idle one is closed")
}

// registerKubernetesFlags defines the Kubernetes source's.
func (c *Config) registerKubernetesFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Kubeconfig, "kubeconfig", "", "watch this Kubernetes cluster's API server with this kubeconfig: Services, EndpointSlices and the Pods of --node-name answer cluster names")
	fs.BoolVar(&c.InCluster, "kubernetes", false, "watch the API server of the cluster the agent runs in (in-cluster service account); the DaemonSet uses this")
	fs.StringVar(&c.NodeName, "node-name", os.Getenv("NODE_NAME"), "this node's name: its Pods' IPs tell the agent each client's namespace (default $NODE_NAME)")
	fs.StringVar(&c.ClusterDNSService, "cluster-dns-service", DefaultClusterDNSService, "with a Kubernetes source and no --nameservers: the Service (namespace/name) whose cluster IPs pods use as nameserver; those are captured")
}

// registerProcessFlags defines the process's: admin address, state
// directory, memory, logs, and the testing-only fault injections.
func (c *Config) registerProcessFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Admin, "admin", "127.0.0.1:9153", "admin HTTP address for /healthz, /readyz and /metrics (empty disables)")
	fs.StringVar(&c.StateDir, "state-dir", agentstate.DefaultStateDir, "directory for the agent's lock, state file and handover socket (shared by an agent and its successor; read by status and cleanup)")
	fs.StringVar(&c.memoryLimit, "memory-limit", os.Getenv(MemoryLimitEnv), "the container's memory limit in bytes: the Go memory limit (GOMEMLIMIT) is set to --memory-limit-ratio of it, unless GOMEMLIMIT is in the environment (default $"+MemoryLimitEnv+")")
	fs.Float64Var(&c.MemoryLimitRatio, "memory-limit-ratio", DefaultMemoryLimitRatio, "share of --memory-limit the Go memory limit is set to")
	fs.StringVar(&c.LogLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.LogFormat, "log-format", "text", "text or json")
	fs.StringVar(&c.forceNoEBPF, "x-force-no-ebpf", "", "testing only: make auto mode behave as if the eBPF probe failed with this reason")
	fs.StringVar(&c.handoverFault, "x-handover-fault", "", "testing only: crash in a handover, as the successor (before serving) or the predecessor (after sending its descriptors)")
	fs.DurationVar(&c.slowSync, "x-slow-sync", 0, "testing only: the name sources' first sync takes at least this long (a slow API server)")
	fs.StringVar(&c.wedgeOn, "x-wedge-on", "", "testing only: the first query for this name wedges the query path (it and every later forwarded query block their reader for good)")
}

// Validate checks what can be checked without touching the system.
func (c *Config) Validate() error {
	switch c.Mode {
	case ModeAuto, ModeEBPF, ModeIptables, ModeOff:
	default:
		return fmt.Errorf("--mode %q: want auto, ebpf, iptables or off", c.Mode)
	}
	if len(c.Listen) == 0 {
		c.Listen = []netip.AddrPort{netip.MustParseAddrPort(DefaultListen)}
	}
	var v4, v6 int
	for _, l := range c.Listen {
		if l.Port() == 0 {
			return fmt.Errorf("--listen %s: a port is required", l)
		}
		if l.Addr().Is4() {
			v4++
		} else {
			v6++
		}
	}
	if v4 > 1 || v6 > 1 {
		return fmt.Errorf("--listen: at most one IPv4 and one IPv6 address")
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		return fmt.Errorf("--log-format %q: want text or json", c.LogFormat)
	}
	if c.UpstreamMark == 0 {
		return fmt.Errorf("--upstream-mark must be non-zero")
	}
	if c.CacheBytes < 0 || c.CacheWorkloadBytes < 0 || c.MaxPending < 0 || c.MaxTCPConns < 0 {
		return fmt.Errorf("--cache-bytes, --cache-workload-bytes, --max-pending and --max-tcp-conns must not be negative")
	}
	if b := c.WorkloadBudget; b.QPS < 0 || b.Burst < 0 || b.InFlight < 0 {
		return fmt.Errorf("--workload-qps, --workload-burst and --workload-max-pending must not be negative")
	}
	lim, err := parseMemoryLimit(c.memoryLimit)
	if err != nil {
		return err
	}
	c.MemoryLimit = lim
	if !(c.MemoryLimitRatio > 0 && c.MemoryLimitRatio <= 1) {
		return fmt.Errorf("--memory-limit-ratio %v: want more than 0 and at most 1", c.MemoryLimitRatio)
	}
	if c.Admin != "" {
		a, err := normalizeAdmin(c.Admin)
		if err != nil {
			return err
		}
		c.Admin = a
	}
	if c.Kubeconfig != "" && c.InCluster {
		return fmt.Errorf("--kubeconfig and --kubernetes: give one (--kubernetes uses the in-cluster service account)")
	}
	if err := c.validateMesh(); err != nil {
		return err
	}
	if err := c.validateIstiod(); err != nil {
		return err
	}
	if err := c.validateEgress(); err != nil {
		return err
	}
	if err := c.validateWorkloads(); err != nil {
		return err
	}
	if c.Kubernetes() && !c.authoritativeSet {
		c.Authoritative = true
	}
	return nil
}

// normalizeAdmin checks --admin and writes it as HOST:PORT. An unbracketed
// IPv6 address with a port ("fd00::7:9153", what --admin=$(NODE_IP):9153
// gives on an IPv6 node) means that address and the port after the last colon.
func normalizeAdmin(s string) (string, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		i := strings.LastIndexByte(s, ':')
		ip, perr := netip.ParseAddr(s[:max(i, 0)])
		if i < 0 || perr != nil || !ip.Is6() {
			return "", fmt.Errorf("--admin %q: want HOST:PORT, [IPv6]:PORT or :PORT", s)
		}
		host, port = ip.String(), s[i+1:]
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return "", fmt.Errorf("--admin %q: %q is not a port number", s, port)
	}
	hostChar := func(r rune) bool {
		return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune(".-:%", r)
	}
	if strings.ContainsFunc(host, func(r rune) bool { return !hostChar(r) }) {
		return "", fmt.Errorf("--admin %q: %q is neither an IP address nor a host name (an unset variable in the DaemonSet?)", s, host)
	}
	return net.JoinHostPort(host, port), nil
}

// IstiodConfig configures the NDS source: istiod's name table over xDS
// (docs/istio.md). The flag names follow what an Istio agent is given.
type IstiodConfig struct {
	Addr      string // --istiod HOST:PORT
	CAFile    string // --istiod-ca-file: TLS with this CA (else plaintext)
	TokenFile string // --istiod-token-file: bearer token (TLS only)
	SAN       string // --istiod-san: istiod's certificate name (default the host of --istiod)
	ClusterID string // --istiod-cluster-id
	View      string // --istiod-view agent|node ("" = node with a Kubernetes source, --node-name and plaintext)
	ProxyName string // --istiod-proxy-name
}

// Istiod view modes.
const (
	IstiodViewAgent = "agent" // one view: a proxy of the agent's namespace, for every client
	IstiodViewNode  = "node"  // plus one view per namespace of this node's Pods
)

func (c *Config) registerIstiodFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.Istiod.Addr, "istiod", "", "take the name table from istiod's NDS over xDS at HOST:PORT (15012 TLS with --istiod-ca-file, 15010 plaintext)")
	fs.StringVar(&c.Istiod.CAFile, "istiod-ca-file", "", "CA certificate (PEM) that signed istiod's serving certificate, e.g. Istio's root-cert.pem: connect with TLS (default plaintext)")
	fs.StringVar(&c.Istiod.TokenFile, "istiod-token-file", "", "Kubernetes service account token (audience istio-ca) sent to istiod as a bearer token, re-read on each connect; needs --istiod-ca-file")
	fs.StringVar(&c.Istiod.SAN, "istiod-san", "", "name istiod's certificate must carry (default the host of --istiod, e.g. istiod.istio-system.svc)")
	fs.StringVar(&c.Istiod.ClusterID, "istiod-cluster-id", "Kubernetes", "the cluster ID the agent's proxies claim (Istio's CLUSTER_ID)")
	fs.Func("istiod-view", "whose name table: agent (one proxy of --namespace, for every client) or node (also one proxy per namespace of this node's Pods; default with a Kubernetes source, --node-name and plaintext)", func(s string) error {
		switch s {
		case IstiodViewAgent, IstiodViewNode:
			c.Istiod.View = s
			return nil
		}
		return fmt.Errorf("want agent or node, got %q", s)
	})
	fs.StringVar(&c.Istiod.ProxyName, "istiod-proxy-name", "", "pod-name part of the proxy IDs the agent presents to istiod: the view of namespace NS is NAME.NS (default meshdns-ebpf-<node name>)")
}

// validateIstiod checks the NDS flags against the rest.
func (c *Config) validateIstiod() error {
	if c.Istiod.Addr == "" {
		return nil
	}
	if _, _, err := net.SplitHostPort(c.Istiod.Addr); err != nil {
		return fmt.Errorf("--istiod %q: want HOST:PORT", c.Istiod.Addr)
	}
	if c.Istiod.TokenFile != "" && c.Istiod.CAFile == "" {
		return fmt.Errorf("--istiod-token-file needs --istiod-ca-file: a token is only sent over TLS")
	}
	if c.Istiod.View == IstiodViewNode && (!c.Kubernetes() || c.NodeName == "") {
		return fmt.Errorf("--istiod-view node needs a Kubernetes source and --node-name: the namespaces of this node's Pods choose the views")
	}
	return nil
}

// Kubernetes reports whether the Kubernetes source is on.
func (c *Config) Kubernetes() bool { return c.Kubeconfig != "" || c.InCluster }

func splitList(s string) []string {
	var out []string
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		if f != "" {
			out = append(out, f)
		}
	}
	return out
}

func parseAddrs(s string) ([]netip.Addr, error) {
	var out []netip.Addr
	for _, f := range splitList(s) {
		a, err := netip.ParseAddr(f)
		if err != nil {
			return nil, fmt.Errorf("%q is not an IP address", f)
		}
		out = append(out, a.Unmap())
	}
	return out, nil
}

// parseAddrPorts parses "ip", "ip:port", "[v6]:port"; defPort 0 makes the port required.
func parseAddrPorts(s string, defPort uint16) ([]netip.AddrPort, error) {
	var out []netip.AddrPort
	for _, f := range splitList(s) {
		if ap, err := netip.ParseAddrPort(f); err == nil {
			out = append(out, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
			continue
		}
		a, err := netip.ParseAddr(strings.Trim(f, "[]"))
		if err != nil || defPort == 0 {
			if defPort == 0 {
				return nil, fmt.Errorf("%q: want ADDR:PORT (IPv6 as [ADDR]:PORT)", f)
			}
			return nil, fmt.Errorf("%q: want ADDR[:PORT]", f)
		}
		out = append(out, netip.AddrPortFrom(a.Unmap(), defPort))
	}
	return out, nil
}

func parseUints(s string) ([]uint32, error) {
	var out []uint32
	for _, f := range splitList(s) {
		v, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("%q is not a numeric id", f)
		}
		out = append(out, uint32(v))
	}
	return out, nil
}
