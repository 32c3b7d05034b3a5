package resolver

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/names/filesource"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

func TestConfigErrors(t *testing.T) {
	ok := Config{Listen: []string{"127.0.0.1:0"}, Table: &staticTable{}, Forwarder: failingForwarder{}}
	tests := []struct {
		name string
		mod  func(*Config)
		want string
	}{
		{"no listen", func(c *Config) { c.Listen = nil }, "no listen address"},
		{"no port", func(c *Config) { c.Listen = []string{"127.0.0.1"} }, `listen address "127.0.0.1"`},
		{"hostname", func(c *Config) { c.Listen = []string{"localhost:53"} }, `"localhost" is not an IP address`},
		{"bad port", func(c *Config) { c.Listen = []string{"127.0.0.1:99999"} }, `port "99999"`},
		{"nil table", func(c *Config) { c.Table = nil }, "Table is nil"},
		{"nil forwarder", func(c *Config) { c.Forwarder = nil }, "Forwarder is nil"},
		{"bad domain", func(c *Config) { c.ClusterDomain = "a..b" }, "cluster domain"},
		{"bad search", func(c *Config) { c.SearchDomains = []string{"x y"} }, "search domain"},
		{"ttl", func(c *Config) { c.TTL = time.Millisecond }, "TTL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ok
			tt.mod(&c)
			_, err := New(c)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New error = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestStartAddressInUse(t *testing.T) {
	for _, network := range []string{"udp", "tcp"} {
		t.Run(network, func(t *testing.T) {
			var addr string
			if network == "udp" {
				pc, err := net.ListenPacket("udp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				defer pc.Close()
				addr = pc.LocalAddr().String()
			} else {
				l, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				defer l.Close()
				addr = l.Addr().String()
			}
			s, err := New(Config{Listen: []string{"127.0.0.1:0", addr}, Table: &staticTable{}, Forwarder: failingForwarder{},
				Logger: slog.New(slog.DiscardHandler)})
			if err != nil {
				t.Fatal(err)
			}
			err = s.Start(context.Background())
			if err == nil || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), "address already in use") {
				t.Fatalf("Start = %v, want an in-use error naming %s", err, addr)
			}
			if got := s.Addrs(); len(got) != 0 {
				t.Fatalf("addresses still bound after a failed Start: %v", got)
			}
		})
	}
}

func TestReady(t *testing.T) {
	ts := startServer(t, nil, nil)
	if err := ts.s.Ready(); err == nil || !strings.Contains(err.Error(), "not published") {
		t.Fatalf("Ready without a table = %v", err)
	}
	// Before the table loads, queries are forwarded, not failed.
	resp := exchange(t, "udp", ts.addr, query("ext.example.org.", dns.TypeA)())
	if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
		t.Fatalf("forward before table: %v", resp)
	}
	tb, err := nametable.Build(testFile(), nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ts.table.t.Store(tb)
	if err := ts.s.Ready(); err != nil {
		t.Fatalf("Ready = %v", err)
	}
	other, _ := nametable.Build(&nametable.File{}, nametable.Options{ClusterDomain: "example.internal"})
	ts.table.t.Store(other)
	if err := ts.s.Ready(); err == nil || !strings.Contains(err.Error(), "cluster domain") {
		t.Fatalf("Ready with a mismatched domain = %v", err)
	}
	if err := ts.s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := ts.s.Ready(); err == nil {
		t.Fatalf("Ready after Shutdown = nil")
	}
}

func TestMultipleListenersAndMetrics(t *testing.T) {
	ts := startServer(t, testFile(), func(c *Config) { c.Listen = []string{"127.0.0.1:0", "[::1]:0", "127.0.0.3:0"} })
	addrs := ts.s.Addrs()
	if len(addrs) != 3 || !strings.HasPrefix(addrs[1], "[::1]:") || !strings.HasPrefix(addrs[2], "127.0.0.3:") {
		t.Fatalf("Addrs = %v", addrs)
	}
	for _, a := range addrs {
		for _, network := range []string{"udp", "tcp"} {
			resp := exchange(t, network, a, query("productpage.ns1.svc.cluster.local.", dns.TypeA)())
			if len(resp.Answer) != 1 {
				t.Fatalf("%s %s: %v", network, a, resp)
			}
		}
	}
	exchange(t, "udp", addrs[0], query("ext.example.org.", dns.TypeA)())
	exchange(t, "tcp", addrs[0], query("productpage.ns1.svc.cluster.local.", dns.TypeMX)())
	// Search-path expansions answered in one round trip: the packed path (A)
	// and the general one (ANY).
	for _, qt := range []uint16{dns.TypeA, dns.TypeANY} {
		if resp := exchange(t, "udp", addrs[0], query("productpage.ns1.ns1.svc.cluster.local.", qt)()); len(resp.Answer) < 2 {
			t.Fatalf("autopath %s: %v", dns.TypeToString[qt], resp)
		}
	}
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"meshdns_dns_requests_total", []string{"proto", "udp", "qtype", "A"}, 5},
		{"meshdns_dns_requests_total", []string{"proto", "tcp", "qtype", "A"}, 3},
		{"meshdns_dns_requests_total", []string{"proto", "tcp", "qtype", "MX"}, 1},
		{"meshdns_dns_responses_total", []string{"rcode", "NOERROR", "source", "table"}, 7},
		{"meshdns_dns_responses_total", []string{"rcode", "NOERROR", "source", "upstream"}, 1},
		{"meshdns_dns_request_duration_seconds", []string{"source", "table"}, 7},
		{"meshdns_dns_request_duration_seconds", []string{"source", "upstream"}, 1},
		{"meshdns_dns_responses_total", []string{"rcode", "NOERROR", "source", "autopath"}, 2},
	} {
		var got float64
		deadline := time.Now().Add(time.Second)
		for {
			got = metrictest.Value(t, ts.reg, c.name, c.labels...)
			if got == c.want || time.Now().After(deadline) {
				break
			}
			time.Sleep(5 * time.Millisecond) // the UDP response leaves before its metric is counted
		}
		if got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

// The handler works inside another miekg/dns server (in-process use).
func TestServeDNSInProcess(t *testing.T) {
	ts := startServer(t, testFile(), nil)
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: ts.s}
	go func() { _ = srv.ActivateAndServe() }()
	t.Cleanup(func() { _ = srv.Shutdown() })
	for _, tc := range []struct {
		q    string
		want string
	}{
		{"reviews.ns2.ns1.svc.cluster.local.", "CNAME"},
		{"productpage.ns1.svc.cluster.local.", "10.0.1.1"},
		{"ext.example.org.", "192.0.2.80"},
	} {
		c := &dns.Client{Net: "udp", Timeout: 2 * time.Second}
		resp, _, err := c.Exchange(query(tc.q, dns.TypeA)(), pc.LocalAddr().String())
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Answer) == 0 || !strings.Contains(resp.Answer[0].String(), tc.want) {
			t.Fatalf("%s: %v", tc.q, resp)
		}
	}
}

// End to end with the real watcher: kubelet-style ..data swap shows up in
// answers within 2s; a bad file keeps the old answer and is counted.
func TestReloadThroughResolver(t *testing.T) {
	dir := t.TempDir()
	write := func(gen int, content string) {
		ts := filepath.Join(dir, "..gen"+string(rune('0'+gen)))
		if err := os.Mkdir(ts, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(ts, "table.yaml"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Base(ts), filepath.Join(dir, "..data_tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	write(1, "table:\n  svc.ns1.svc.cluster.local:\n    registry: Kubernetes\n    ips: [10.9.0.1]\n")
	if err := os.Symlink("..data/table.yaml", filepath.Join(dir, "table.yaml")); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	m, err := names.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	w, err := names.New(names.Config{Metrics: m, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	fs, err := filesource.NewFile(filepath.Join(dir, "table.yaml"), filesource.Options{Domain: w.Domain(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Add(fs, names.SourceOptions{Priority: names.PriorityFile}); err != nil {
		t.Fatal(err)
	}
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	fileErrors := func() float64 { return metrictest.Value(t, reg, "meshdns_names_source_errors_total", "source", "file") }

	up := startUpstream(t)
	s, err := New(Config{Listen: []string{"127.0.0.1:0"}, Table: w, Forwarder: newForwarder(t, up.addr, nil),
		Logger: slog.New(slog.DiscardHandler), OnReaders: raiseProcs})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Shutdown(context.Background()) })
	addr := s.Addrs()[0]
	answer := func() string {
		resp := exchange(t, "udp", addr, query("svc.ns1.", dns.TypeA)())
		if len(resp.Answer) != 1 {
			return dns.RcodeToString[resp.Rcode]
		}
		return resp.Answer[0].(*dns.A).A.String()
	}
	waitAnswer := func(want string) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Second)
		for {
			got := answer()
			if got == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("answer %s, want %s within 2s", got, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitAnswer("10.9.0.1")
	if err := s.Ready(); err != nil {
		t.Fatalf("Ready = %v", err)
	}
	write(2, "table:\n  svc.ns1.svc.cluster.local:\n    registry: Kubernetes\n    ips: [10.9.0.2]\n")
	waitAnswer("10.9.0.2")
	write(3, "table:\n  svc.ns1.svc.cluster.local:\n    registry: Kubernetes\n    ips: [10.9.0.300]\n")
	deadline := time.Now().Add(2 * time.Second)
	for fileErrors() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if st := w.Status(); len(st) != 1 || !strings.Contains(st[0].LastError, "ips[0]") {
		t.Fatalf("source status = %+v", st)
	}
	if got := answer(); got != "10.9.0.2" {
		t.Fatalf("after a bad file: %s, want the previous 10.9.0.2", got)
	}
	if got := fileErrors(); got != 1 {
		t.Fatalf("file source errors = %v", got)
	}
	if err := s.Ready(); err != nil {
		t.Fatalf("Ready with an old good table = %v", err)
	}
}

// On a wildcard address the reply must leave from the address the query
// was sent to, or a connected client never sees it.
func TestWildcardListenReplySource(t *testing.T) {
	for _, listen := range []string{"0.0.0.0:0", ":0"} {
		t.Run(listen, func(t *testing.T) {
			ts := startServer(t, testFile(), func(c *Config) { c.Listen = []string{listen} })
			_, port, _ := net.SplitHostPort(ts.addr)
			for _, dst := range []string{"127.0.0.1", "127.0.0.5"} {
				for _, network := range []string{"udp", "tcp"} {
					resp := exchange(t, network, net.JoinHostPort(dst, port), query("productpage.ns1.svc.cluster.local.", dns.TypeA)())
					if len(resp.Answer) != 1 {
						t.Fatalf("%s via %s: %v", network, dst, resp)
					}
				}
			}
		})
	}
}

// Start tells the process, once, how many readers keep a scheduler slot
// while they wait (one UDP socket per CPU per address on Linux); the resolver
// itself leaves GOMAXPROCS alone.
func TestStartReportsBlockingReaders(t *testing.T) {
	before := runtime.GOMAXPROCS(0)
	var got []int
	ts := startServer(t, nil, func(c *Config) {
		c.Listen = []string{"127.0.0.1:0", "[::1]:0"}
		c.OnReaders = func(n int) { got = append(got, n) }
	})
	want := 2 * runtime.NumCPU()
	if !reusePortSupported {
		want = 0
	}
	if len(got) != 1 || got[0] != want {
		t.Errorf("OnReaders called with %v, want once with %d", got, want)
	}
	if n := runtime.GOMAXPROCS(0); n != before {
		t.Errorf("GOMAXPROCS %d after Start, was %d: the resolver set it", n, before)
	}
	_ = ts
}
