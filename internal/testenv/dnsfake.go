package testenv

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// FakeDNS is a fake nameserver for tests: it answers the names in Records (A or AAAA
// by the address family; "*.zone" answers every name one label below zone) and
// NXDOMAIN with an SOA for everything else, over UDP and TCP, and records every
// query it sees. It stands for "the original nameserver"
// or an upstream; it never forwards anywhere.
type FakeDNS struct {
	Addr string // host:port it serves on

	mu      sync.Mutex
	records map[string][]netip.Addr
	delays  map[string]time.Duration
	queries []Query
	servers []*dns.Server
	udp     *net.UDPConn
	tcp     *net.TCPListener

	onRead    atomic.Pointer[func(n int)]
	readDelay atomic.Int64  // nanoseconds each read waits before it reads
	frozen    chan struct{} // non-nil while frozen: reads wait until it is closed
}

// Query is one query a FakeDNS saw.
type Query struct {
	Name   string // lower-case FQDN
	Type   uint16
	Proto  string // "udp" or "tcp"
	Source netip.AddrPort
}

// StartFakeDNS serves on addr ("ip:port"; port 0 picks one, the same for UDP and
// TCP) inside ns (nil: the test's own namespace) until the test ends.
func StartFakeDNS(t testing.TB, ns *Netns, addr string, records map[string][]netip.Addr) *FakeDNS {
	t.Helper()
	f := &FakeDNS{records: map[string][]netip.Addr{}, delays: map[string]time.Duration{}}
	for name, ips := range records {
		f.records[dns.CanonicalName(name)] = ips
	}
	listen := func() error {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			return err
		}
		for attempt := 0; ; attempt++ {
			udp, err := net.ListenPacket("udp", net.JoinHostPort(host, port))
			if err != nil {
				return fmt.Errorf("listen udp %s: %w", addr, err)
			}
			bound := udp.LocalAddr().(*net.UDPAddr)
			// Plain TCP, not Go's default MPTCP: a resolver's listener must be
			// one the datapath can register (SOCKMAP takes TCP, not MPTCP).
			var lc net.ListenConfig
			lc.SetMultipathTCP(false)
			tcp, err := lc.Listen(context.Background(), "tcp", net.JoinHostPort(host, fmt.Sprint(bound.Port)))
			if err != nil {
				udp.Close()
				if port == "0" && attempt < 10 {
					continue // the TCP port of the same number was taken; pick again
				}
				return fmt.Errorf("listen tcp %s: %w", addr, err)
			}
			f.Addr = net.JoinHostPort(host, fmt.Sprint(bound.Port))
			f.udp, f.tcp = udp.(*net.UDPConn), tcp.(*net.TCPListener)
			for _, s := range []*dns.Server{
				{PacketConn: udp, Handler: dns.HandlerFunc(f.serve("udp")), DecorateReader: f.decorate},
				{Listener: tcp, Handler: dns.HandlerFunc(f.serve("tcp")), DecorateReader: f.decorate},
			} {
				started := make(chan struct{})
				s.NotifyStartedFunc = func() { close(started) }
				f.servers = append(f.servers, s)
				go s.ActivateAndServe()
				<-started
			}
			return nil
		}
	}
	var err error
	if ns != nil {
		err = ns.Do(listen)
	} else {
		err = listen()
	}
	if err != nil {
		t.Fatalf("start fake DNS on %s: %v", addr, err)
	}
	t.Cleanup(f.Close)
	return f
}

// Close stops the server.
func (f *FakeDNS) Close() {
	for _, s := range f.servers {
		_ = s.Shutdown()
	}
	f.servers = nil
}

// Conns returns the server's UDP socket and TCP listener (to register them
// with the datapath as a resolver's sockets).
func (f *FakeDNS) Conns() (*net.UDPConn, *net.TCPListener) { return f.udp, f.tcp }

// OnRead sets a function called (with 1) for every message the server reads
// (UDP datagrams, empty ones included, and TCP messages), before it is
// handled: a resolver's progress signal.
func (f *FakeDNS) OnRead(fn func(n int)) { f.onRead.Store(&fn) }

// Freeze stops the server reading its sockets (queries queue up, as with a
// SIGSTOPped resolver) until the returned function is called.
func (f *FakeDNS) Freeze() (thaw func()) {
	ch := make(chan struct{})
	f.mu.Lock()
	f.frozen = ch
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			f.frozen = nil
			f.mu.Unlock()
			close(ch)
		})
	}
}

// SetReadDelay makes the server wait d before each read from its sockets: a
// resolver that is slow to dequeue (CPU-starved) but still makes progress.
func (f *FakeDNS) SetReadDelay(d time.Duration) { f.readDelay.Store(int64(d)) }

// SetDelay makes the server wait d before answering name (0: answer at once).
func (f *FakeDNS) SetDelay(name string, d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.delays[dns.CanonicalName(name)] = d
}

// decorate wraps the server's reader: it waits while frozen and reports every
// read to OnRead.
func (f *FakeDNS) decorate(r dns.Reader) dns.Reader { return &fakeReader{f: f, r: r} }

type fakeReader struct {
	f *FakeDNS
	r dns.Reader
}

func (fr *fakeReader) wait() {
	if d := fr.f.readDelay.Load(); d > 0 {
		time.Sleep(time.Duration(d)) // the resolver's simulated slowness
	}
	fr.f.mu.Lock()
	ch := fr.f.frozen
	fr.f.mu.Unlock()
	if ch != nil {
		<-ch
	}
}

func (fr *fakeReader) read() {
	if fn := fr.f.onRead.Load(); fn != nil {
		(*fn)(1)
	}
}

func (fr *fakeReader) ReadTCP(conn net.Conn, timeout time.Duration) ([]byte, error) {
	fr.wait()
	b, err := fr.r.ReadTCP(conn, timeout)
	if err == nil {
		fr.read()
	}
	return b, err
}

func (fr *fakeReader) ReadUDP(conn *net.UDPConn, timeout time.Duration) ([]byte, *dns.SessionUDP, error) {
	fr.wait()
	b, s, err := fr.r.ReadUDP(conn, timeout)
	if err == nil {
		fr.read()
	}
	return b, s, err
}

func (fr *fakeReader) ReadPacketConn(conn net.PacketConn, timeout time.Duration) ([]byte, net.Addr, error) {
	fr.wait()
	b, a, err := fr.r.(dns.PacketConnReader).ReadPacketConn(conn, timeout)
	if err == nil {
		fr.read()
	}
	return b, a, err
}

// Set replaces the addresses of one name.
func (f *FakeDNS) Set(name string, ips ...netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.records[dns.CanonicalName(name)] = ips
}

// Queries returns a copy of the queries seen so far.
func (f *FakeDNS) Queries() []Query {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Query(nil), f.queries...)
}

// Count returns how many queries for name (any type) were seen.
func (f *FakeDNS) Count(name string) int {
	name = dns.CanonicalName(name)
	n := 0
	for _, q := range f.Queries() {
		if q.Name == name {
			n++
		}
	}
	return n
}

// Reset forgets the queries seen so far.
func (f *FakeDNS) Reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.queries = nil
}

func (f *FakeDNS) serve(proto string) func(w dns.ResponseWriter, req *dns.Msg) {
	return func(w dns.ResponseWriter, req *dns.Msg) {
		resp := new(dns.Msg)
		if len(req.Question) != 1 {
			resp.SetRcode(req, dns.RcodeFormatError)
			_ = w.WriteMsg(resp)
			return
		}
		resp.SetReply(req)
		resp.RecursionAvailable = true
		q := req.Question[0]
		name := strings.ToLower(q.Name)
		src, _ := netip.ParseAddrPort(w.RemoteAddr().String())
		f.mu.Lock()
		f.queries = append(f.queries, Query{Name: name, Type: q.Qtype, Proto: proto, Source: src})
		ips, ok := f.records[name]
		delay := f.delays[name]
		if !ok {
			// "*.zone" records answer every name under zone.
			if _, zone, found := strings.Cut(name, "."); found {
				ips, ok = f.records["*."+zone]
				delay = f.delays["*."+zone]
			}
		}
		f.mu.Unlock()
		if delay > 0 {
			time.Sleep(delay) // the upstream is slow for this name
		}
		if !ok {
			resp.Rcode = dns.RcodeNameError
			resp.Ns = []dns.RR{&dns.SOA{
				Hdr: dns.RR_Header{Name: ".", Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 5},
				Ns:  "fake.test.", Mbox: "hostmaster.fake.test.", Serial: 1, Refresh: 60, Retry: 60, Expire: 60, Minttl: 5,
			}}
		}
		for _, ip := range ips {
			hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 5}
			switch {
			case q.Qtype == dns.TypeA && ip.Is4():
				hdr.Rrtype = dns.TypeA
				resp.Answer = append(resp.Answer, &dns.A{Hdr: hdr, A: ip.AsSlice()})
			case q.Qtype == dns.TypeAAAA && ip.Is6():
				hdr.Rrtype = dns.TypeAAAA
				resp.Answer = append(resp.Answer, &dns.AAAA{Hdr: hdr, AAAA: ip.AsSlice()})
			}
		}
		_ = w.WriteMsg(resp)
	}
}

// WaitFor polls cond every 20 ms until it holds or timeout passes.
func WaitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}
