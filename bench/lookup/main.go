// Command lookup times whole name lookups the way glibc's getaddrinfo(AF_UNSPEC) does
// them with a pod's resolv.conf: a name with fewer than -ndots dots is tried with each
// -search suffix in turn, then as given; each try sends A and AAAA in parallel on one
// socket and waits for both; the lookup ends at the first try where either has
// addresses (a CNAME chain ending in addresses counts), and fails when none has. It
// prints one JSON object: lookups, failures, queries sent, and the lookup time's mean,
// p50 and p99 in microseconds. The benchmark runs it from the captured cgroup, so its
// queries go through the eBPF datapath.
package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/miekg/dns"
)

type result struct {
	Lookups, Failed, Queries int
	MeanUS, P50US, P99US     float64
	QueriesPerLookup         float64
}

func main() {
	server := flag.String("server", "", "nameserver ip:port (the captured one)")
	names := flag.String("names", "", "file with one name per line")
	search := flag.String("search", "", "search suffixes, comma-separated, in order")
	ndots := flag.Int("ndots", 5, "names with fewer dots are tried with the search suffixes first")
	timeout := flag.Duration("timeout", 2*time.Second, "per try")
	passes := flag.Int("passes", 1, "passes over the names")
	flag.Parse()
	if err := run(*server, *names, *search, *ndots, *timeout, *passes); err != nil {
		fmt.Fprintln(os.Stderr, "lookup:", err)
		os.Exit(1)
	}
}

func run(server, namesFile, search string, ndots int, timeout time.Duration, passes int) error {
	f, err := os.Open(namesFile)
	if err != nil {
		return err
	}
	var list []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if n := strings.TrimSpace(sc.Text()); n != "" {
			list = append(list, strings.TrimSuffix(n, "."))
		}
	}
	f.Close()
	var suffixes []string
	for _, s := range strings.Split(search, ",") {
		if s = strings.Trim(strings.TrimSpace(s), "."); s != "" {
			suffixes = append(suffixes, s)
		}
	}
	c, err := net.Dial("udp", server)
	if err != nil {
		return err
	}
	defer c.Close()
	var res result
	var times []time.Duration
	id := uint16(1)
	buf := make([]byte, 4096)
	for range passes {
		for _, name := range list {
			tries := []string{name + "."}
			if strings.Count(name, ".") < ndots {
				tries = tries[:0]
				for _, s := range suffixes {
					tries = append(tries, name+"."+s+".")
				}
				tries = append(tries, name+".")
			}
			start := time.Now()
			found := false
			for _, try := range tries {
				ok, err := ask(c, try, &id, buf, timeout)
				res.Queries += 2
				if err != nil {
					break
				}
				if ok {
					found = true
					break
				}
			}
			times = append(times, time.Since(start))
			res.Lookups++
			if !found {
				res.Failed++
			}
		}
	}
	slices.Sort(times)
	var sum time.Duration
	for _, t := range times {
		sum += t
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	if len(times) > 0 {
		res.MeanUS = us(sum / time.Duration(len(times)))
		res.P50US = us(times[len(times)/2])
		res.P99US = us(times[min(len(times)-1, len(times)*99/100)])
		res.QueriesPerLookup = float64(res.Queries) / float64(res.Lookups)
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// ask sends A and AAAA for name and reports whether either answer has addresses.
func ask(c net.Conn, name string, id *uint16, buf []byte, timeout time.Duration) (bool, error) {
	ids := [2]uint16{}
	for i, qt := range []uint16{dns.TypeA, dns.TypeAAAA} {
		m := new(dns.Msg)
		m.SetQuestion(name, qt)
		*id++
		m.Id, ids[i] = *id, *id
		pkt, err := m.Pack()
		if err != nil {
			return false, err
		}
		if _, err := c.Write(pkt); err != nil {
			return false, err
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	got, addrs := 0, false
	for got < 2 {
		n, err := c.Read(buf)
		if err != nil {
			return addrs, err
		}
		if n < 12 {
			continue
		}
		rid := binary.BigEndian.Uint16(buf)
		if rid != ids[0] && rid != ids[1] {
			continue // a late answer to an earlier try
		}
		got++
		m := new(dns.Msg)
		if m.Unpack(buf[:n]) != nil {
			continue
		}
		for _, rr := range m.Answer {
			if t := rr.Header().Rrtype; t == dns.TypeA || t == dns.TypeAAAA {
				addrs = true
			}
		}
	}
	return addrs, nil
}
