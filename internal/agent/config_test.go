package agent

import (
	"flag"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// runFlags is a Config with the flags of `run` registered on a silent flag set.
func runFlags() (*Config, *flag.FlagSet) {
	var c Config
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	return &c, fs
}

func parseRun(t *testing.T, args ...string) (*Config, error) {
	t.Helper()
	c, fs := runFlags()
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	return c, c.Validate()
}

func TestFlags(t *testing.T) {
	ap := netip.MustParseAddrPort
	a := netip.MustParseAddr
	tests := []struct {
		name    string
		args    []string
		check   func(*Config) bool
		wantErr string
	}{
		{"defaults", nil, func(c *Config) bool {
			return c.Mode == ModeAuto && reflect.DeepEqual(c.Listen, []netip.AddrPort{ap(DefaultListen)}) &&
				c.UpstreamMark == 0x3f53 && c.BPFFS == "/sys/fs/bpf/meshdns"
		}, ""},
		{"listen v4+v6", []string{"--listen", "169.254.20.53:53,[fd53::53]:53"}, func(c *Config) bool {
			return reflect.DeepEqual(c.Listen, []netip.AddrPort{ap("169.254.20.53:53"), ap("[fd53::53]:53")})
		}, ""},
		{"upstream default port", []string{"--upstream", "169.254.53.1, 127.0.0.1:5300,fd00::1"}, func(c *Config) bool {
			return reflect.DeepEqual(c.Upstreams, []netip.AddrPort{ap("169.254.53.1:53"), ap("127.0.0.1:5300"), ap("[fd00::1]:53")})
		}, ""},
		{"nameservers unmapped", []string{"--nameservers", "::ffff:169.254.53.1,fd53::1"}, func(c *Config) bool {
			return reflect.DeepEqual(c.Nameservers, []netip.Addr{a("169.254.53.1"), a("fd53::1")})
		}, ""},
		{"proxy uids", []string{"--proxy-uid", "1337,0"}, func(c *Config) bool {
			return reflect.DeepEqual(c.ProxyUIDs, []uint32{1337, 0})
		}, ""},
		{"mark hex", []string{"--upstream-mark", "0x10"}, func(c *Config) bool { return c.UpstreamMark == 0x10 }, ""},
		{"istiod", []string{"--istiod", "istiod.istio-system.svc:15012", "--istiod-ca-file", "/ca.pem", "--istiod-token-file", "/tok", "--istiod-view", "agent"}, func(c *Config) bool {
			return c.Istiod.Addr == "istiod.istio-system.svc:15012" && c.Istiod.View == IstiodViewAgent && c.Istiod.ClusterID == "Kubernetes"
		}, ""},
		{"istiod without port", []string{"--istiod", "istiod.istio-system.svc"}, nil, "--istiod"},
		{"istiod token in plaintext", []string{"--istiod", "istiod:15010", "--istiod-token-file", "/tok"}, nil, "needs --istiod-ca-file"},
		{"istiod node view without kubernetes", []string{"--istiod", "istiod:15010", "--istiod-view", "node"}, nil, "needs a Kubernetes source"},
		{"istiod bad view", []string{"--istiod-view", "pod"}, nil, "want agent or node"},
		{"bad mode", []string{"--mode", "magic"}, nil, "--mode"},
		{"listen without port", []string{"--listen", "169.254.20.53"}, nil, "ADDR:PORT"},
		{"two v4 listens", []string{"--listen", "127.0.0.1:53,127.0.0.2:53"}, nil, "at most one IPv4"},
		{"bad nameserver", []string{"--nameservers", "dns.example"}, nil, "not an IP address"},
		{"bad uid", []string{"--proxy-uid", "istio"}, nil, "numeric id"},
		{"zero mark", []string{"--upstream-mark", "0"}, nil, "non-zero"},
		{"bad log format", []string{"--log-format", "xml"}, nil, "--log-format"},
		// The DaemonSet passes --admin=$(NODE_IP):9153: on an IPv6 node that is
		// "fd00::7:9153", which must mean [fd00::7]:9153, not a failed start.
		{"admin node ipv6", []string{"--admin", "fd00::7:9153"}, func(c *Config) bool { return c.Admin == "[fd00::7]:9153" }, ""},
		{"admin bracketed", []string{"--admin", "[fd00::7]:9153"}, func(c *Config) bool { return c.Admin == "[fd00::7]:9153" }, ""},
		{"admin v4", []string{"--admin", "10.1.2.3:9153"}, func(c *Config) bool { return c.Admin == "10.1.2.3:9153" }, ""},
		{"admin any", []string{"--admin", ":9153"}, func(c *Config) bool { return c.Admin == ":9153" }, ""},
		{"admin off", []string{"--admin", ""}, func(c *Config) bool { return c.Admin == "" }, ""},
		{"admin without port", []string{"--admin", "10.1.2.3"}, nil, "--admin"},
		{"admin bad port", []string{"--admin", "10.1.2.3:http"}, nil, "--admin"},
		{"admin empty NODE_IP", []string{"--admin", "$(NODE_IP):9153"}, nil, "--admin"},
		{"filter-aaaa off by default", nil, func(c *Config) bool { return !c.FilterAAAA }, ""},
		{"filter-aaaa external", []string{"--filter-aaaa", "external"}, func(c *Config) bool { return c.FilterAAAA }, ""},
		{"filter-aaaa off", []string{"--filter-aaaa=external", "--filter-aaaa=off"}, func(c *Config) bool { return !c.FilterAAAA }, ""},
		{"filter-aaaa bad", []string{"--filter-aaaa", "all"}, nil, "want external or off"},
		{"egress off by default", nil, func(c *Config) bool { return !c.Egress.Enabled && c.Egress.MaxGrants > 0 }, ""},
		{"egress", []string{"--egress", "--egress-internal-cidrs", "10.244.1.7/16, fd00::/48", "--egress-workload-grants", "100"}, func(c *Config) bool {
			return c.Egress.Enabled && reflect.DeepEqual(c.Egress.Internal, []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00::/48")}) &&
				c.Egress.WorkloadGrants == 100
		}, ""},
		{"egress policy file without egress", []string{"--egress-policy-file", "/etc/meshdns/egress.yaml"}, nil, "need --egress"},
		{"egress bad cidr", []string{"--egress", "--egress-internal-cidrs", "10.244.0.0"}, nil, "--egress-internal-cidrs"},
		{"egress in iptables mode", []string{"--egress", "--mode", "iptables"}, nil, "needs the eBPF datapath"},
		{"egress quota over the cap", []string{"--egress", "--egress-max-grants", "10", "--egress-workload-grants", "11"}, nil, "--egress-workload-grants"},
		{"cache workload share by default", nil, func(c *Config) bool { return c.CacheWorkloadBytes == 0 }, ""},
		{"cache workload share", []string{"--cache-workload-bytes", "65536"}, func(c *Config) bool { return c.CacheWorkloadBytes == 65536 }, ""},
		{"cache workload share negative", []string{"--cache-workload-bytes", "-1"}, nil, "--cache-workload-bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseRun(t, tc.args...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if !tc.check(c) {
				t.Errorf("config not as expected: %+v", *c)
			}
		})
	}
}

// The nameservers and upstreams of the start plan: from the flags, else
// resolv.conf, without our own addresses; the Config is left as it was.
func TestResolveServers(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tests := []struct {
		name      string
		conf      string
		args      []string
		wantNS    []string
		wantUp    []string
		wantError string
	}{
		{"both from resolv.conf", "nameserver 169.254.53.1\nnameserver fd53::1\nsearch a.b\n", nil,
			[]string{"169.254.53.1", "fd53::1"}, []string{"169.254.53.1:53", "[fd53::1]:53"}, ""},
		{"flags win", "nameserver 169.254.53.1\n", []string{"--nameservers", "169.254.53.9", "--upstream", "127.0.0.1:5300"},
			[]string{"169.254.53.9"}, []string{"127.0.0.1:5300"}, ""},
		{"own listen address never upstream nor captured", "nameserver 169.254.20.53\nnameserver 169.254.53.1\n", nil,
			[]string{"169.254.53.1"}, []string{"169.254.53.1:53"}, ""},
		{"same address, other port is a real upstream", "nameserver 169.254.53.1\n",
			[]string{"--listen", "127.0.0.1:5353", "--upstream", "127.0.0.1:5300,127.0.0.1:5353,127.0.0.1:5354"},
			[]string{"169.254.53.1"}, []string{"127.0.0.1:5300", "127.0.0.1:5354"}, ""},
		{"capture-all slot ports are ours too", "nameserver 169.254.53.1\n",
			[]string{"--listen", "127.0.0.1:5353", "--capture-all", "--upstream", "127.0.0.1:5300,127.0.0.1:5357,127.0.0.1:5358"},
			[]string{"169.254.53.1"}, []string{"127.0.0.1:5300", "127.0.0.1:5358"}, ""},
		{"nothing upstream", "search only\n", nil, nil, nil, "no nameserver"},
		{"nothing to capture", "nameserver 169.254.53.1\n", []string{"--nameservers", "169.254.20.53"}, nil, nil, "nothing to capture"},
		{"duplicate nameserver", "nameserver 169.254.53.1\n", []string{"--nameservers", "169.254.53.9,169.254.53.8,169.254.53.9"}, nil, nil, "nameserver 169.254.53.9 is listed twice"},
		{"duplicate nameserver in iptables mode", "nameserver 169.254.53.1\n", []string{"--mode", "iptables", "--nameservers", "fd53::9,fd53::9"}, nil, nil, "nameserver fd53::9 is listed twice"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := write(strings.ReplaceAll(tc.name, " ", "_"), tc.conf)
			c, err := parseRun(t, append([]string{"--resolv-conf", path}, tc.args...)...)
			if err != nil {
				t.Fatal(err)
			}
			given, givenUp := slices.Clone(c.Nameservers), slices.Clone(c.Upstreams)
			nss, ups, _, err := c.resolveServers(c.Nameservers, log)
			if !slices.Equal(c.Nameservers, given) || !slices.Equal(c.Upstreams, givenUp) {
				t.Errorf("the Config was written: nameservers %v upstreams %v, given %v %v", c.Nameservers, c.Upstreams, given, givenUp)
			}
			if tc.wantError != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantError) {
					t.Fatalf("err = %v, want %q", err, tc.wantError)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var ns, up []string
			for _, n := range nss {
				ns = append(ns, n.String())
			}
			for _, u := range ups {
				up = append(up, u.String())
			}
			if !reflect.DeepEqual(ns, tc.wantNS) || !reflect.DeepEqual(up, tc.wantUp) {
				t.Errorf("nameservers %v upstreams %v, want %v %v", ns, up, tc.wantNS, tc.wantUp)
			}
		})
	}
}

// A nameserver listed twice is refused by the datapath of either mode, with
// an error naming it (one capture plan, internal/captureplan), as the
// agent's plan refuses it before either is made (TestResolveServers).
func TestDuplicateNameserverRefusedByEveryDatapath(t *testing.T) {
	c, err := parseRun(t, "--nameservers", "169.254.53.9", "--upstream", "127.0.0.1:5300")
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	p := &startPlan{cgroup: "/sys/fs/cgroup", nameservers: []netip.Addr{netip.MustParseAddr("169.254.53.9"), netip.MustParseAddr("::ffff:169.254.53.9")}}
	const want = "nameserver 169.254.53.9 is listed twice"
	if _, err := redirect.New(c.redirectConfig(p, log)); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("eBPF datapath: %v, want an error containing %q", err, want)
	}
	if _, err := ctzone.New(c.ctzoneConfig(p, log)); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("iptables datapath: %v, want an error containing %q", err, want)
	}
}
