// Command fakeupstream is the benchmark's upstream nameserver on loopback. It
// answers every A query with a deterministic address (198.18.0.0/15, derived from
// the name) and TTL -ttl, every other type with NODATA plus an SOA, and names under
// any of the -nx suffixes with NXDOMAIN plus an SOA (by default also the mesh
// zone, as the cluster's own DNS would answer it), so every answer a peer
// forwards is cacheable. It
// never forwards anywhere. -stats serves the number of queries seen over HTTP
// (GET /queries), so the runner can check that cached scenarios stay off the upstream.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
)

// handler answers queries; see the package doc.
type handler struct {
	ttl uint32
	nx  []string // lower-case FQDN suffixes answered with NXDOMAIN
}

func (h *handler) soa(zone string) dns.RR {
	return &dns.SOA{
		Hdr: dns.RR_Header{Name: zone, Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: h.ttl},
		Ns:  "ns.fake-upstream.", Mbox: "hostmaster.fake-upstream.",
		Serial: 1, Refresh: 7200, Retry: 1800, Expire: 86400, Minttl: h.ttl,
	}
}

// answer builds the reply to req.
func (h *handler) answer(req *dns.Msg) *dns.Msg {
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	m.RecursionAvailable = true
	if len(req.Question) != 1 {
		m.Rcode = dns.RcodeFormatError
		return m
	}
	q := req.Question[0]
	name := strings.ToLower(q.Name)
	for _, nx := range h.nx {
		if dns.IsSubDomain(nx, name) {
			m.Rcode = dns.RcodeNameError
			m.Ns = []dns.RR{h.soa(nx)}
			return m
		}
	}
	if q.Qtype == dns.TypeA && q.Qclass == dns.ClassINET {
		m.Answer = []dns.RR{&dns.A{
			Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: h.ttl},
			A:   meshdata.ExternalIP(name).AsSlice(),
		}}
		return m
	}
	zone := "."
	if labels := dns.SplitDomainName(name); len(labels) >= 2 {
		zone = dns.Fqdn(strings.Join(labels[len(labels)-2:], "."))
	}
	m.Ns = []dns.RR{h.soa(zone)}
	return m
}

// respond is the dnsfake answering function: the answer, truncated over UDP to the
// client's advertised size as a real server does.
func (h *handler) respond(proto string, req *dns.Msg) []*dns.Msg {
	m := h.answer(req)
	if proto == "udp" {
		size := 512
		if opt := req.IsEdns0(); opt != nil {
			size = int(opt.UDPSize())
		}
		m.Truncate(size)
	}
	return []*dns.Msg{m}
}

func main() {
	listen := flag.String("listen", "127.0.0.1:5300", "UDP and TCP address to serve on")
	ttl := flag.Uint("ttl", 300, "TTL of every answer (and SOA minimum)")
	nx := flag.String("nx", "nx.example.net.,cluster.local.", "names under these suffixes (comma-separated) get NXDOMAIN")
	stats := flag.String("stats", "", "if set, serve GET /queries (count of queries seen) on this address")
	flag.Parse()
	if err := run(*listen, uint32(*ttl), *nx, *stats); err != nil {
		slog.Error("fakeupstream", "err", err)
		os.Exit(1)
	}
}

func run(listen string, ttl uint32, nx, stats string) error {
	h := &handler{ttl: ttl}
	for s := range strings.SplitSeq(nx, ",") {
		if s = strings.TrimSpace(s); s != "" {
			h.nx = append(h.nx, strings.ToLower(dns.Fqdn(s)))
		}
	}
	srv, err := dnsfake.Listen(dnsfake.Config{Addr: listen, Respond: h.respond, NoRecord: true})
	if err != nil {
		return err
	}
	defer srv.Close()
	errc := make(chan error, 1)
	if stats != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("GET /queries", func(w http.ResponseWriter, _ *http.Request) {
			fmt.Fprintln(w, srv.Count())
		})
		hs := &http.Server{Addr: stats, Handler: mux}
		go func() { errc <- hs.ListenAndServe() }()
	}
	slog.Info("fakeupstream serving", "addr", listen, "ttl", ttl, "nx", h.nx)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	select {
	case <-ctx.Done():
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	}
	slog.Info("fakeupstream stopped", "queries", srv.Count())
	return nil
}
