package resolver

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// staticTable is a TableSource with a fixed table (nil = not loaded).
type staticTable struct {
	t atomic.Pointer[nametable.Table]
}

func (s *staticTable) Table() *nametable.Table { return s.t.Load() }

// fakeUpstream is the shared fake nameserver (internal/dnsfake) on 127.0.0.1 that
// knows a few external names and answers NXDOMAIN otherwise.
type fakeUpstream struct {
	*dnsfake.Server
	addr string
}

func upstreamAnswer(t testing.TB) dnsfake.Respond {
	return func(_ string, r *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(r)
		m.RecursionAvailable = true
		q := r.Question[0]
		name := strings.ToLower(q.Name)
		switch {
		case name == "ext.example.org." && q.Qtype == dns.TypeA:
			m.Answer = []dns.RR{mustRR(t, "ext.example.org. 300 IN A 192.0.2.80")}
		case name == "star*.example.org." && q.Qtype == dns.TypeA:
			m.Answer = []dns.RR{mustRR(t, "star*.example.org. 300 IN A 192.0.2.82")}
		case name == "case.example.org." && q.Qtype == dns.TypeA:
			m.Answer = []dns.RR{mustRR(t, "case.example.org. 300 IN CNAME edge.example.net."), mustRR(t, "edge.example.net. 300 IN A 192.0.2.81")}
		case name == "www.example.com." && q.Qtype == dns.TypeA:
			m.Answer = []dns.RR{mustRR(t, "www.example.com. 300 IN CNAME edge.example.net."), mustRR(t, "edge.example.net. 300 IN A 192.0.2.81")}
		case name == "many.example.org." && q.Qtype == dns.TypeA:
			for i := range 40 {
				m.Answer = append(m.Answer, mustRR(t, fmt.Sprintf("many.example.org. 300 IN A 192.0.2.%d", i+1)))
			}
		case name == "big.example.org." && q.Qtype == dns.TypeTXT:
			for i := range 40 {
				m.Answer = append(m.Answer, mustRR(t, fmt.Sprintf("big.example.org. 300 IN TXT \"%s-%02d\"", strings.Repeat("x", 60), i)))
			}
		case name == "ext.example.org." || name == "www.example.com.":
			m.Ns = []dns.RR{mustRR(t, "example.org. 300 IN SOA ns.example.org. h.example.org. 1 2 3 4 300")}
		default:
			m.Rcode = dns.RcodeNameError
			m.Ns = []dns.RR{mustRR(t, ". 300 IN SOA a.root. h.root. 1 2 3 4 300")}
		}
		if o := r.IsEdns0(); o != nil {
			m.SetEdns0(4096, o.Do())
			// An option we must not pass on to our client.
			opt := m.IsEdns0()
			opt.Option = append(opt.Option, &dns.EDNS0_NSID{Code: dns.EDNS0NSID, Nsid: "abcd"})
		}
		return []*dns.Msg{m}
	}
}

func startUpstream(t testing.TB) *fakeUpstream {
	t.Helper()
	s, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: upstreamAnswer(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return &fakeUpstream{Server: s, addr: s.Addr.String()}
}

// newForwarder is a started upstream.Forwarder to addr on reg, its config
// changed by opts.
func newForwarder(t testing.TB, addr string, reg prometheus.Registerer, opts ...func(*upstream.Config)) *upstream.Forwarder {
	t.Helper()
	cfg := upstream.NewConfig(netip.MustParseAddrPort(addr))
	cfg.Registerer = reg
	for _, o := range opts {
		o(&cfg)
	}
	f, err := upstream.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// failingForwarder fails every forwarded query (the upstreams are down).
type failingForwarder struct{}

func (failingForwarder) Cached(*upstream.Query) (upstream.Answer, bool) {
	return upstream.Answer{}, false
}
func (failingForwarder) ForwardAsync(_ *upstream.Query, done upstream.Waiter) {
	done(upstream.Answer{}, upstream.ErrAllFailed)
}

func mustRR(t testing.TB, s string) dns.RR {
	t.Helper()
	rr, err := dns.NewRR(s)
	if err != nil {
		t.Fatalf("NewRR(%q): %v", s, err)
	}
	return rr
}

type testServer struct {
	s     *Server
	addr  string
	reg   *prometheus.Registry
	table *staticTable
	up    *fakeUpstream
}

func startServer(t *testing.T, f *nametable.File, mod func(*Config)) *testServer {
	t.Helper()
	var tb *nametable.Table
	if f != nil {
		var err error
		if tb, err = nametable.Build(f, nametable.Options{}); err != nil {
			t.Fatal(err)
		}
	}
	return startServerTable(t, tb, mod)
}

// buildTable builds a table from hosts of one source, keyed by name, and
// clients (IP -> namespace).
func buildTable(t *testing.T, hosts []nametable.Host, clients map[string]string) *nametable.Table {
	t.Helper()
	b, err := nametable.NewBuilder(nametable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.AddSource("test", 0)
	for _, h := range hosts {
		if err := b.Set("test", h.Name, []nametable.Host{h}); err != nil {
			t.Fatal(err)
		}
	}
	for ip, ns := range clients {
		if err := b.SetClients("test", ip, []netip.Addr{netip.MustParseAddr(ip)}, ns); err != nil {
			t.Fatal(err)
		}
	}
	tb, err := b.Publish()
	if err != nil {
		t.Fatal(err)
	}
	return tb
}

func startServerTable(t *testing.T, tb *nametable.Table, mod func(*Config)) *testServer {
	t.Helper()
	up := startUpstream(t)
	ts := &testServer{reg: prometheus.NewRegistry(), table: &staticTable{}, up: up}
	if tb != nil {
		ts.table.t.Store(tb)
	}
	cfg := Config{
		Listen:     []string{"127.0.0.1:0"},
		Table:      ts.table,
		Forwarder:  newForwarder(t, up.addr, ts.reg),
		Registerer: ts.reg,
		Logger:     slog.New(slog.DiscardHandler),
		OnReaders:  raiseProcs,
	}
	if mod != nil {
		mod(&cfg)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
	})
	ts.s = s
	ts.addr = s.Addrs()[0]
	return ts
}

// exchangeRaw sends wire bytes and returns the raw reply.
func exchangeRaw(t *testing.T, network, addr string, pkt []byte) []byte {
	t.Helper()
	c, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if network == "tcp" {
		pkt = append([]byte{byte(len(pkt) >> 8), byte(len(pkt))}, pkt...)
	}
	if _, err := c.Write(pkt); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 65536+2)
	if network == "tcp" {
		if _, err := readFull(c, buf[:2]); err != nil {
			t.Fatalf("read length: %v", err)
		}
		n := int(buf[0])<<8 | int(buf[1])
		if _, err := readFull(c, buf[:n]); err != nil {
			t.Fatalf("read: %v", err)
		}
		return buf[:n]
	}
	n, err := c.Read(buf)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return buf[:n]
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

func exchange(t *testing.T, network, addr string, req *dns.Msg) *dns.Msg {
	t.Helper()
	pkt, err := req.Pack()
	if err != nil {
		t.Fatal(err)
	}
	raw := exchangeRaw(t, network, addr, pkt)
	resp := new(dns.Msg)
	if err := resp.Unpack(raw); err != nil {
		t.Fatalf("unpack response: %v (%x)", err, raw)
	}
	return resp
}

// canon renders a whole message for comparison: header, question, and each
// section, with runs of A/AAAA records sorted (they are shuffled).
func canon(m *dns.Msg) string {
	var b strings.Builder
	fmt.Fprintf(&b, "id=%d qr=%v op=%d aa=%v tc=%v rd=%v ra=%v ad=%v cd=%v rcode=%s\n",
		m.Id, m.Response, m.Opcode, m.Authoritative, m.Truncated, m.RecursionDesired,
		m.RecursionAvailable, m.AuthenticatedData, m.CheckingDisabled, dns.RcodeToString[m.Rcode])
	for _, q := range m.Question {
		fmt.Fprintf(&b, "Q %s\n", q.String())
	}
	sec := func(tag string, rrs []dns.RR) {
		lines := make([]string, 0, len(rrs))
		run := -1
		for _, rr := range rrs {
			s := rr.String()
			if o, ok := rr.(*dns.OPT); ok {
				s = fmt.Sprintf("OPT udp=%d do=%v ver=%d ext=%d opts=%d", o.UDPSize(), o.Do(), o.Version(), o.ExtendedRcode(), len(o.Option))
			}
			t := rr.Header().Rrtype
			if t == dns.TypeA || t == dns.TypeAAAA {
				if run < 0 {
					run = len(lines)
				}
			} else if run >= 0 {
				slices.Sort(lines[run:])
				run = -1
			}
			lines = append(lines, s)
		}
		if run >= 0 {
			slices.Sort(lines[run:])
		}
		for _, l := range lines {
			fmt.Fprintf(&b, "%s %s\n", tag, l)
		}
	}
	sec("AN", m.Answer)
	sec("NS", m.Ns)
	sec("AR", m.Extra)
	return b.String()
}

// raiseProcs is Config.OnReaders in tests: as the agent does
// (internal/agent/tune.go), the process gets a scheduler slot per blocking
// UDP reader plus one. The resolver leaves GOMAXPROCS to the process, and
// without the spare slot everything else waits for the runtime to take one
// back from a reader.
func raiseProcs(blocking int) {
	if want := blocking + 1; runtime.GOMAXPROCS(0) < want {
		runtime.GOMAXPROCS(want)
	}
}
