// Command dnsblast sends N A queries for a name to a server, each on its own
// socket: connected (connect + send + recv, like glibc and Go) or unconnected
// (sendto + recvfrom, like musl). It checks that each answer comes back and, for
// unconnected sockets, that it comes from the address the query was sent to. It
// prints the number of answers and their first address.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/miekg/dns"
)

func main() {
	n := flag.Int("n", 1, "queries")
	server := flag.String("server", "", "server ip:port")
	unconnected := flag.Bool("unconnected", false, "sendto/recvfrom on an unconnected socket")
	tcp := flag.Bool("tcp", false, "one TCP connection per query")
	flag.Parse()
	name := dns.Fqdn(flag.Arg(0))
	dst := netip.MustParseAddrPort(*server)
	ok, first := 0, ""
	for i := 0; i < *n; i++ {
		m := new(dns.Msg)
		m.SetQuestion(name, dns.TypeA)
		resp, err := query(m, dst, *unconnected, *tcp)
		if err != nil {
			fmt.Fprintf(os.Stderr, "dnsblast: query %d: %v\n", i, err)
			os.Exit(1)
		}
		ok++
		if first == "" {
			first = dns.RcodeToString[resp.Rcode]
			if len(resp.Answer) > 0 {
				if a, isA := resp.Answer[0].(*dns.A); isA {
					first = a.A.String()
				}
			}
		}
	}
	fmt.Println(ok, first)
}

func query(m *dns.Msg, dst netip.AddrPort, unconnected, tcp bool) (*dns.Msg, error) {
	wire, err := m.Pack()
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(3 * time.Second)
	if tcp {
		c, err := net.DialTimeout("tcp", dst.String(), 3*time.Second)
		if err != nil {
			return nil, err
		}
		defer c.Close()
		dc := &dns.Conn{Conn: c}
		_ = c.SetDeadline(deadline)
		if err := dc.WriteMsg(m); err != nil {
			return nil, err
		}
		return dc.ReadMsg()
	}
	if unconnected {
		c, err := net.ListenUDP("udp", nil)
		if err != nil {
			return nil, err
		}
		defer c.Close()
		_ = c.SetDeadline(deadline)
		if _, err := c.WriteToUDPAddrPort(wire, dst); err != nil {
			return nil, err
		}
		buf := make([]byte, 4096)
		nr, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return nil, err
		}
		if netip.AddrPortFrom(from.Addr().Unmap(), from.Port()) != dst {
			return nil, fmt.Errorf("reply from %v, sent to %v", from, dst)
		}
		r := new(dns.Msg)
		return r, r.Unpack(buf[:nr])
	}
	c, err := net.Dial("udp", dst.String())
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(deadline)
	if _, err := c.Write(wire); err != nil {
		return nil, err
	}
	buf := make([]byte, 4096)
	nr, err := c.Read(buf)
	if err != nil {
		return nil, err
	}
	r := new(dns.Msg)
	return r, r.Unpack(buf[:nr])
}
