package upstream

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/panicguard"
)

// Defaults applied by NewConfig and by New to zero-valued fields.
const (
	DefaultTimeout        = 3 * time.Second
	DefaultAttemptTimeout = 500 * time.Millisecond
	DefaultMinAttempt     = 100 * time.Millisecond
	DefaultMaxFails       = 3
	DefaultMaxInFlight    = 1000
	DefaultCacheSize      = 100000
	// DefaultCacheBytes keeps the cache well inside the DaemonSet's 256 MiB memory
	// limit, with room for the Go heap's growth headroom, the name table and traffic.
	DefaultCacheBytes = 32 << 20
	// DefaultCacheWorkloadParts: one workload's misses may hold 1/64 of the cache's
	// bytes (512 KiB of the default 32 MiB: about a thousand answers), so 64 workloads
	// each at their share fill it, and one cannot grow it alone.
	DefaultCacheWorkloadParts = 64
	DefaultMinTTL             = 5 * time.Second
	DefaultMaxTTL             = time.Hour
	DefaultMaxNegTTL          = 30 * time.Minute
	DefaultStaleTTL           = time.Hour
	DefaultHealthInterval     = 500 * time.Millisecond

	// SilenceForDown is how long an upstream that answered before must have answered
	// nothing at all before its timeouts count as failures (MaxFails).
	SilenceForDown = time.Second

	// StaleAnswerTTL is the TTL (seconds) of every record in a stale answer, as RFC 8767
	// recommends.
	StaleAnswerTTL = 30
	// EDNSBufferSize is the UDP payload size advertised to upstreams (the DNS flag day
	// 2020 value), so answers larger than 512 bytes are not lost on the way back.
	EDNSBufferSize = 1232
	// PrefetchPercent and PrefetchMinHits: an entry is refreshed ahead of expiry when it
	// is served from the cache PrefetchMinHits times while less than PrefetchPercent of
	// its TTL is left.
	PrefetchPercent = 10
	PrefetchMinHits = 3
)

// Config configures a Forwarder. Zero durations and sizes mean the default; see the
// field comments for the values that disable a feature.
type Config struct {
	// Servers are the upstream nameservers, tried in random order among the healthy
	// ones. At least one is required.
	Servers []netip.AddrPort
	// Mark is the SO_MARK set on every upstream socket (0 = none). The eBPF datapath and
	// the iptables fallback use it to never capture the resolver's own queries.
	Mark uint32
	// Timeout bounds a whole upstream resolution (all attempts) before the caller
	// answers SERVFAIL. A reply to any earlier attempt is accepted until then, so an
	// upstream slower than one attempt's timeout is still answered.
	Timeout time.Duration
	// AttemptTimeout is the per-attempt timeout of an upstream before its round-trip
	// time has been measured. After that each upstream's timeout is its smoothed RTT
	// plus four deviations (RFC 6298), at least MinAttemptTimeout, doubled after each
	// timeout until a clean sample.
	AttemptTimeout    time.Duration
	MinAttemptTimeout time.Duration
	// MaxFails consecutive failed attempts (timeouts or socket errors) mark an
	// upstream unhealthy; any answer resets the count. A timeout counts only when the
	// upstream replied to nothing at all since the query's resolution began, nor for
	// SilenceForDown: one that answers some queries and drops others (rate limiting,
	// loss) is alive, and its drops are counted as reason="dropped".
	MaxFails int
	// MaxInFlight caps concurrent upstream queries; beyond it Forward fails fast with
	// ErrOverloaded (or serves a stale answer when it has one).
	MaxInFlight int
	// CacheSize is the cache capacity in entries: 0 = default, negative = no cache.
	CacheSize int
	// CacheBytes caps the cache's memory (its estimate of each entry's footprint):
	// 0 = default.
	CacheBytes int
	// CacheWorkloadBytes caps the cache bytes charged to one workload (Query.Owner, the
	// workload whose miss fetched the answer); over it the workload's own oldest
	// entries are evicted: 0 = CacheBytes/DefaultCacheWorkloadParts, negative = no cap.
	CacheWorkloadBytes int
	// MinTTL is the floor, MaxTTL the cap of a positive answer's cache lifetime, and
	// MaxNegTTL the cap of a negative (NXDOMAIN/NODATA) one.
	MinTTL, MaxTTL, MaxNegTTL time.Duration
	// StaleTTL is how long past expiry an entry may be served stale when every
	// upstream fails (RFC 8767): 0 = default, negative = never serve stale.
	StaleTTL time.Duration
	// Prefetch refreshes popular entries before they expire. NewConfig turns it on.
	Prefetch bool
	// HealthInterval is the probe interval of an upstream while it is unhealthy.
	HealthInterval time.Duration
	// Registerer receives the meshdns_cache_* and meshdns_upstream_* metrics (nil = not
	// registered).
	Registerer prometheus.Registerer
	// Logger receives state changes (upstream down/up); nil discards.
	Logger *slog.Logger
	// Panics counts panics recovered in upstream resolutions (their waiters get
	// ErrPanic); nil: they are only logged.
	Panics *panicguard.Counter
}

// NewConfig returns a Config for servers with every default set, prefetch included.
func NewConfig(servers ...netip.AddrPort) Config {
	c := Config{Servers: servers, Prefetch: true}
	c.setDefaults()
	return c
}

func (c *Config) setDefaults() {
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.AttemptTimeout == 0 {
		c.AttemptTimeout = DefaultAttemptTimeout
	}
	if c.MinAttemptTimeout == 0 {
		c.MinAttemptTimeout = DefaultMinAttempt
	}
	if c.MaxFails == 0 {
		c.MaxFails = DefaultMaxFails
	}
	if c.CacheBytes == 0 {
		c.CacheBytes = DefaultCacheBytes
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.CacheSize == 0 {
		c.CacheSize = DefaultCacheSize
	}
	if c.MinTTL == 0 {
		c.MinTTL = DefaultMinTTL
	}
	if c.MaxTTL == 0 {
		c.MaxTTL = DefaultMaxTTL
	}
	if c.MaxNegTTL == 0 {
		c.MaxNegTTL = DefaultMaxNegTTL
	}
	if c.StaleTTL == 0 {
		c.StaleTTL = DefaultStaleTTL
	}
	if c.HealthInterval == 0 {
		c.HealthInterval = DefaultHealthInterval
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

func (c *Config) validate() error {
	if len(c.Servers) == 0 {
		return errors.New("no upstream servers configured")
	}
	seen := make(map[netip.AddrPort]bool, len(c.Servers))
	for _, s := range c.Servers {
		if !s.IsValid() || s.Port() == 0 {
			return fmt.Errorf("invalid upstream server %q: need address and non-zero port", s)
		}
		if seen[s] {
			return fmt.Errorf("upstream server %s listed twice", s)
		}
		seen[s] = true
	}
	switch {
	case c.Timeout < 0, c.AttemptTimeout < 0, c.MinAttemptTimeout < 0, c.MaxFails < 0, c.CacheBytes < 0, c.MinTTL < 0, c.MaxTTL < 0, c.MaxNegTTL < 0, c.HealthInterval < 0:
		return errors.New("negative timeout, TTL, interval, size or count")
	case c.MaxInFlight < 0:
		return fmt.Errorf("max in-flight %d is negative", c.MaxInFlight)
	case c.MinTTL > c.MaxTTL:
		return fmt.Errorf("min TTL %s above max TTL %s", c.MinTTL, c.MaxTTL)
	case c.MinTTL > c.MaxNegTTL:
		return fmt.Errorf("min TTL %s above max negative TTL %s", c.MinTTL, c.MaxNegTTL)
	}
	if c.AttemptTimeout > c.Timeout {
		c.AttemptTimeout = c.Timeout
	}
	if c.MinAttemptTimeout > c.AttemptTimeout {
		c.MinAttemptTimeout = c.AttemptTimeout
	}
	return nil
}

// workloadBytes is the cache's cap per workload: CacheWorkloadBytes, its default
// (a share of CacheBytes, whatever CacheBytes was set to after NewConfig), or 0
// (no cap).
func (c *Config) workloadBytes() int {
	switch {
	case c.CacheWorkloadBytes < 0:
		return 0
	case c.CacheWorkloadBytes == 0:
		return max(c.CacheBytes/DefaultCacheWorkloadParts, 1)
	}
	return c.CacheWorkloadBytes
}
