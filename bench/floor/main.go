// Command floor is the benchmark's floor: a bare miekg/dns server that answers
// the mesh table from a map (A records from a hosts file, NXDOMAIN/NODATA with a
// synthesized SOA for the rest of the mesh zone), and everything else from a
// plain map cache filled by forwarding to one upstream. No metrics, no health,
// no limits: what a straightforward Go resolver costs per query. With -reload it
// polls the hosts file and swaps the table when it changes (used by the scale
// runs as a reference).
package main

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

// table maps lower-case FQDNs to their IPv4 addresses.
type table map[string][]netip.Addr

// parseHosts reads "IP NAME..." lines.
func parseHosts(data []byte) (table, error) {
	t := table{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for line := 1; sc.Scan(); line++ {
		f := strings.Fields(sc.Text())
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		ip, err := netip.ParseAddr(f[0])
		if err != nil || len(f) < 2 {
			return nil, fmt.Errorf("line %d: want \"IP NAME\": %q", line, sc.Text())
		}
		for _, n := range f[1:] {
			n = strings.ToLower(dns.Fqdn(n))
			t[n] = append(t[n], ip)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("scan hosts: %w", err)
	}
	return t, nil
}

type cacheKey struct {
	name  string
	qtype uint16
}

type cacheEntry struct {
	msg     *dns.Msg
	expires time.Time
}

// server is the floor resolver.
type server struct {
	zone     string // lower-case FQDN of the mesh zone
	ttl      uint32
	upstream string
	client   *dns.Client
	tab      atomic.Pointer[table]

	mu    sync.RWMutex
	cache map[cacheKey]cacheEntry
}

func (s *server) soa() dns.RR {
	return &dns.SOA{
		Hdr: dns.RR_Header{Name: s.zone, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: s.ttl},
		Ns:  "ns.dns." + s.zone, Mbox: "hostmaster." + s.zone,
		Serial: 1, Refresh: 7200, Retry: 1800, Expire: 86400, Minttl: s.ttl,
	}
}

// local answers names inside the mesh zone; ok is false for names outside it.
func (s *server) local(req *dns.Msg) (m *dns.Msg, ok bool) {
	q := req.Question[0]
	name := strings.ToLower(q.Name)
	if !dns.IsSubDomain(s.zone, name) {
		return nil, false
	}
	m = new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	ips, found := (*s.tab.Load())[name]
	switch {
	case !found:
		m.Rcode = dns.RcodeNameError
		m.Ns = []dns.RR{s.soa()}
	case q.Qtype == dns.TypeA:
		for _, ip := range ips {
			m.Answer = append(m.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: s.ttl},
				A:   ip.AsSlice(),
			})
		}
	default:
		m.Ns = []dns.RR{s.soa()}
	}
	return m, true
}

// forward answers from the cache, or asks upstream and caches the answer for its
// smallest TTL (the SOA minimum for negative answers).
func (s *server) forward(req *dns.Msg) *dns.Msg {
	q := req.Question[0]
	key := cacheKey{strings.ToLower(q.Name), q.Qtype}
	s.mu.RLock()
	e, ok := s.cache[key]
	s.mu.RUnlock()
	if ok && time.Now().Before(e.expires) {
		m := e.msg.Copy()
		m.Id = req.Id
		m.Question = req.Question
		return m
	}
	up := new(dns.Msg)
	up.SetQuestion(q.Name, q.Qtype)
	resp, _, err := s.client.Exchange(up, s.upstream)
	if err != nil {
		m := new(dns.Msg)
		m.SetRcode(req, dns.RcodeServerFailure)
		return m
	}
	if ttl, ok := minTTL(resp); ok && (resp.Rcode == dns.RcodeSuccess || resp.Rcode == dns.RcodeNameError) && !resp.Truncated {
		s.mu.Lock()
		s.cache[key] = cacheEntry{msg: resp.Copy(), expires: time.Now().Add(time.Duration(ttl) * time.Second)}
		s.mu.Unlock()
	}
	resp.Id = req.Id
	resp.Question = req.Question
	return resp
}

func minTTL(m *dns.Msg) (uint32, bool) {
	var ttl uint32
	found := false
	for _, sec := range [][]dns.RR{m.Answer, m.Ns} {
		for _, rr := range sec {
			t := rr.Header().Ttl
			if soa, ok := rr.(*dns.SOA); ok && soa.Minttl < t {
				t = soa.Minttl
			}
			if !found || t < ttl {
				ttl, found = t, true
			}
		}
	}
	return ttl, found
}

func (s *server) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	if len(req.Question) != 1 {
		m := new(dns.Msg)
		m.SetRcode(req, dns.RcodeFormatError)
		_ = w.WriteMsg(m)
		return
	}
	m, ok := s.local(req)
	if !ok {
		m = s.forward(req)
	}
	m.RecursionAvailable = true
	if w.LocalAddr().Network() == "udp" {
		size := 512
		if opt := req.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		m.Truncate(size)
	}
	_ = w.WriteMsg(m)
}

func (s *server) load(path string) (int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("read hosts %s: %w", path, err)
	}
	t, err := parseHosts(data)
	if err != nil {
		return 0, fmt.Errorf("parse hosts %s: %w", path, err)
	}
	s.tab.Store(&t)
	return len(t), nil
}

func main() {
	listen := flag.String("listen", "127.0.0.1:5310", "UDP and TCP address to serve on")
	hosts := flag.String("hosts", "", "hosts file (IP NAME) with the mesh table")
	zone := flag.String("zone", "cluster.local.", "mesh zone (NXDOMAIN for names not in the table)")
	ttl := flag.Uint("ttl", 30, "TTL of table answers")
	upstream := flag.String("upstream", "127.0.0.1:5300", "upstream for names outside the zone")
	reload := flag.Duration("reload", 0, "poll the hosts file this often and reload it on change (0: never)")
	flag.Parse()
	if err := run(*listen, *hosts, *zone, uint32(*ttl), *upstream, *reload); err != nil {
		slog.Error("floor", "err", err)
		os.Exit(1)
	}
}

func run(listen, hosts, zone string, ttl uint32, upstream string, reload time.Duration) error {
	s := &server{
		zone: strings.ToLower(dns.Fqdn(zone)), ttl: ttl, upstream: upstream,
		client: &dns.Client{Net: "udp", Timeout: 2 * time.Second},
		cache:  map[cacheKey]cacheEntry{},
	}
	start := time.Now()
	n, err := s.load(hosts)
	if err != nil {
		return err
	}
	slog.Info("floor table loaded", "names", n, "took", time.Since(start))
	pc, err := net.ListenPacket("udp", listen)
	if err != nil {
		return fmt.Errorf("listen udp %s: %w", listen, err)
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("listen tcp %s: %w", listen, err)
	}
	errc := make(chan error, 2)
	udp := &dns.Server{PacketConn: pc, Handler: s}
	tcp := &dns.Server{Listener: ln, Handler: s}
	go func() { errc <- udp.ActivateAndServe() }()
	go func() { errc <- tcp.ActivateAndServe() }()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if reload > 0 {
		go s.poll(ctx, hosts, reload)
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	}
	_ = udp.Shutdown()
	_ = tcp.Shutdown()
	return nil
}

// poll reloads path whenever its size or modification time changes.
func (s *server) poll(ctx context.Context, path string, every time.Duration) {
	last, _ := os.Stat(path)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		fi, err := os.Stat(path)
		if err != nil || (last != nil && fi.ModTime().Equal(last.ModTime()) && fi.Size() == last.Size()) {
			continue
		}
		last = fi
		start := time.Now()
		n, err := s.load(path)
		if err != nil {
			slog.Warn("floor reload failed", "err", err)
			continue
		}
		slog.Info("floor table reloaded", "names", n, "took", time.Since(start))
	}
}
