package testenv

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// FakeDNS is a fake nameserver for tests: it answers the names in Records (A or AAAA
// by the address family) and NXDOMAIN with an SOA for everything else, over UDP and
// TCP, and records every query it sees. It stands for "the original nameserver"
// or an upstream; it never forwards anywhere.
type FakeDNS struct {
	Addr string // host:port it serves on

	mu      sync.Mutex
	records map[string][]netip.Addr
	queries []Query
	servers []*dns.Server
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
	f := &FakeDNS{records: map[string][]netip.Addr{}}
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
			tcp, err := net.Listen("tcp", net.JoinHostPort(host, fmt.Sprint(bound.Port)))
			if err != nil {
				udp.Close()
				if port == "0" && attempt < 10 {
					continue // the TCP port of the same number was taken; pick again
				}
				return fmt.Errorf("listen tcp %s: %w", addr, err)
			}
			f.Addr = net.JoinHostPort(host, fmt.Sprint(bound.Port))
			for _, s := range []*dns.Server{
				{PacketConn: udp, Handler: dns.HandlerFunc(f.serve("udp"))},
				{Listener: tcp, Handler: dns.HandlerFunc(f.serve("tcp"))},
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
		f.mu.Unlock()
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
