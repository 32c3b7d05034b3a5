// Command goegress runs resolve -> connect cycles with Go's pure resolver and
// net.Dial, as a Go application does, and prints the same report as
// testdata/egressload (the C library's clients):
//
//	goegress -n CYCLES -p PORT [-u] [-x PREFIX] name
//
// Each cycle resolves name (IPv4), then at once dials TCP (or, with -u, UDP: one
// datagram and its echo) to the first address on PORT. With -x PREFIX (a /16,
// e.g. 198.19) it dials an address under PREFIX that no answer named instead.
// Every cycle that did not connect is printed as
//
//	FAIL <cycle> <address> <what>      (what: eperm, timeout, err:<text>)
//
// and at the end
//
//	SUMMARY cycles=N ok=N eperm=N failed=N retrans=0 p50_us=N p99_us=N max_us=N
//
// (Go's net package does not expose TCP_INFO; retrans is always 0 here.)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"syscall"
	"time"
)

func main() {
	cycles := flag.Int("n", 1000, "resolve -> connect cycles")
	port := flag.Int("p", 0, "destination port")
	udp := flag.Bool("u", false, "UDP: one datagram and its echo")
	never := flag.String("x", "", "connect to addresses under this /16 that no answer named")
	flag.Parse()
	if flag.NArg() != 1 || *port <= 0 || *cycles <= 0 {
		fmt.Fprintln(os.Stderr, "usage: goegress -n CYCLES -p PORT [-u] [-x PREFIX] name")
		os.Exit(2)
	}
	name := flag.Arg(0)
	r := &net.Resolver{PreferGo: true}
	var ok, eperm, failed int
	lat := make([]time.Duration, 0, *cycles)
	for i := range *cycles {
		addr, err := target(r, name, *never, i)
		if err != nil {
			fmt.Printf("FAIL %d - resolve:%v\n", i, err)
			failed++
			continue
		}
		t0 := time.Now()
		err = dial(addr, *port, *udp)
		d := time.Since(t0)
		switch {
		case err == nil:
			ok++
			lat = append(lat, d)
		case errors.Is(err, syscall.EPERM):
			eperm++
			fmt.Printf("FAIL %d %s eperm\n", i, addr)
		case errors.Is(err, os.ErrDeadlineExceeded):
			failed++
			fmt.Printf("FAIL %d %s timeout\n", i, addr)
		default:
			failed++
			fmt.Printf("FAIL %d %s err:%v\n", i, addr, err)
		}
	}
	slices.Sort(lat)
	pct := func(q float64) int64 {
		if len(lat) == 0 {
			return 0
		}
		return lat[min(int(float64(len(lat))*q), len(lat)-1)].Microseconds()
	}
	fmt.Printf("SUMMARY cycles=%d ok=%d eperm=%d failed=%d retrans=0 p50_us=%d p99_us=%d max_us=%d\n",
		*cycles, ok, eperm, failed, pct(0.5), pct(0.99), pct(1))
}

// target is the address of cycle i: name's first IPv4 address, or under never.
func target(r *net.Resolver, name, never string, i int) (netip.Addr, error) {
	if never != "" {
		return netip.ParseAddr(fmt.Sprintf("%s.%d.%d", never, (i/250)%256, 1+i%250))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addrs, err := r.LookupNetIP(ctx, "ip4", name)
	if err != nil {
		return netip.Addr{}, err
	}
	if len(addrs) == 0 {
		return netip.Addr{}, errors.New("no address")
	}
	return addrs[0].Unmap(), nil
}

// dial connects to addr:port and closes the connection; for UDP it waits for
// one datagram's echo.
func dial(addr netip.Addr, port int, udp bool) error {
	network := "tcp4"
	if udp {
		network = "udp4"
	}
	c, err := net.DialTimeout(network, net.JoinHostPort(addr.String(), strconv.Itoa(port)), 3*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if !udp {
		return nil
	}
	if err := c.SetDeadline(time.Now().Add(2 * time.Second)); err != nil {
		return err
	}
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	buf := make([]byte, 16)
	_, err = c.Read(buf)
	return err
}
