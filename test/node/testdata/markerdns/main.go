// Command markerdns is the test node's stand-in cluster DNS: it answers every A
// query with one marker address (and every other type with an empty answer),
// over UDP and TCP. A lookup that returns the marker was answered by "the
// original nameserver", not by meshdns-ebpf.
package main

import (
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"

	"github.com/miekg/dns"
)

func main() {
	addr := flag.String("addr", ":53", "listen address (UDP and TCP)")
	marker := flag.String("marker", "192.0.2.53", "the address of every answer")
	flag.Parse()
	ip := net.ParseIP(*marker).To4()
	if ip == nil {
		log.Fatalf("markerdns: -marker %q is not an IPv4 address", *marker)
	}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		r := new(dns.Msg)
		r.SetReply(q)
		r.Authoritative = true
		for _, question := range q.Question {
			if question.Qtype == dns.TypeA {
				r.Answer = append(r.Answer, &dns.A{
					Hdr: dns.RR_Header{Name: question.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 0},
					A:   ip,
				})
			}
		}
		_ = w.WriteMsg(r)
	})
	for _, network := range []string{"udp", "tcp"} {
		srv := &dns.Server{Addr: *addr, Net: network, Handler: handler}
		go func() { log.Fatal(srv.ListenAndServe()) }()
	}
	log.Printf("markerdns: answering every name with %s on %s", ip, *addr)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	<-sigs
}
