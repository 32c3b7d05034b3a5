// Command goload is dnsload (testdata/dnsload) with Go's own resolver: it
// resolves name=ip targets in turn at a fixed total rate from several
// goroutines until SIGTERM or -d, one net.Resolver lookup (A only) per call
// (a name with "%d" gets a new number each time), and prints every lookup that did not return the expected address as
//
//	FAIL <start ns> <end ns> <name> <what>
//
// (CLOCK_MONOTONIC), then SUMMARY sent=N ok=N wrong=N nxdomain=N failed=N.
//
// With -raw it sends each query itself (a fresh connected UDP socket per
// query, like glibc), to the nameserver of -server, so that an answer with an
// error code (servfail) is told apart from no answer at all (lost): the
// summary then also has servfail=N and lost=N. -unconnected sends each raw query
// from an unconnected socket, as musl does, and counts a reply whose source is
// not the nameserver asked as wrongsrc (it keeps waiting for the right one).
//
// -i also stops at the end of standard input (a test driving it through
// `kubectl exec -i` stops it by closing the stream).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
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
	"golang.org/x/sys/unix"
)

func monotonic() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

type target struct {
	name string
	want netip.Addr
}

// config is what the flags and arguments say.
type config struct {
	rate             float64
	workers          int
	dur, timeout     time.Duration
	raw, unconnected bool
	server           string
	watchStdin       bool
	targets          []target
}

func parseFlags() config {
	var c config
	flag.Float64Var(&c.rate, "r", 100, "lookups per second, in total")
	flag.IntVar(&c.workers, "t", 8, "goroutines")
	flag.DurationVar(&c.dur, "d", time.Hour, "how long")
	flag.BoolVar(&c.raw, "raw", false, "send the queries directly to -server and count servfail and lost apart")
	flag.StringVar(&c.server, "server", "", "with -raw: nameserver ip:port")
	flag.DurationVar(&c.timeout, "timeout", 3*time.Second, "with -raw: how long to wait for an answer")
	flag.BoolVar(&c.unconnected, "unconnected", false, "with -raw: send from an unconnected socket and count replies from another source")
	flag.BoolVar(&c.watchStdin, "i", false, "also stop at the end of standard input")
	flag.Parse()
	for _, a := range flag.Args() {
		name, ip, ok := strings.Cut(a, "=")
		want, err := netip.ParseAddr(ip)
		if !ok || err != nil {
			fmt.Fprintf(os.Stderr, "goload: bad target %s\n", a)
			os.Exit(2)
		}
		c.targets = append(c.targets, target{name, want})
	}
	if len(c.targets) == 0 {
		fmt.Fprintln(os.Stderr, "goload: need name=ip arguments")
		os.Exit(2)
	}
	return c
}

// load is one run: its configuration and what its lookups saw.
type load struct {
	config
	sent, ok, wrong, nx, failed, servfail, lost, wrongSrc atomic.Int64
	mu                                                    sync.Mutex // one FAIL line at a time
}

func main() {
	l := &load{config: parseFlags()}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, l.dur)
	defer cancel()
	if l.watchStdin {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			cancel()
		}()
	}
	fmt.Printf("START %d\n", monotonic())
	interval := time.Duration(float64(time.Second) * float64(l.workers) / l.rate)
	var wg sync.WaitGroup
	for w := range l.workers {
		wg.Go(func() { l.worker(ctx, w, interval) })
	}
	wg.Wait()
	l.summary()
}

// worker looks targets up in turn, one every interval (offset by its share of
// it), until ctx ends.
func (l *load) worker(ctx context.Context, w int, interval time.Duration) {
	next := time.Now().Add(interval * time.Duration(w) / time.Duration(l.workers))
	for i := w; ctx.Err() == nil; i++ {
		time.Sleep(time.Until(next)) // the load's pace
		next = next.Add(interval)
		t := l.targets[i%len(l.targets)]
		name := t.name
		if strings.Contains(name, "%d") {
			name = fmt.Sprintf(name, w*100000000+i)
		}
		if l.raw {
			l.rawLookup(name, t.want)
		} else {
			l.goLookup(name, t.want)
		}
	}
}

// rawLookup sends the query itself and counts its outcome.
func (l *load) rawLookup(name string, want netip.Addr) {
	start := monotonic()
	what := ""
	if l.unconnected {
		var strays []string
		what, strays = exchangeUnconnected(l.server, name, want, l.timeout)
		for _, src := range strays {
			l.wrongSrc.Add(1)
			l.report(start, monotonic(), name, "wrongsrc:"+src)
		}
	} else {
		what = exchange(l.server, name, want, l.timeout)
	}
	end := monotonic()
	l.sent.Add(1)
	switch what {
	case "ok":
		l.ok.Add(1)
		return
	case "servfail":
		l.servfail.Add(1)
	case "nxdomain":
		l.nx.Add(1)
	case "lost":
		l.lost.Add(1)
	default:
		l.wrong.Add(1)
	}
	l.report(start, end, name, what)
}

// goLookup looks name up with Go's resolver and counts its outcome.
func (l *load) goLookup(name string, want netip.Addr) {
	start := monotonic()
	// A Resolver per lookup: one Resolver merges concurrent lookups of a
	// name into one query (singleflight), which would count one lost
	// query as many failed lookups. Not bound to ctx: a lookup in flight
	// at the stop finishes.
	r := &net.Resolver{PreferGo: true}
	ips, err := r.LookupNetIP(context.Background(), "ip4", name)
	end := monotonic()
	l.sent.Add(1)
	var dnsErr *net.DNSError
	switch {
	case err == nil && len(ips) > 0 && ips[0].Unmap() == want:
		l.ok.Add(1)
	case err == nil:
		l.wrong.Add(1)
		l.report(start, end, name, fmt.Sprintf("wrong:%v", ips))
	case errors.As(err, &dnsErr) && dnsErr.IsNotFound:
		l.nx.Add(1)
		l.report(start, end, name, "nxdomain")
	default:
		l.failed.Add(1)
		l.report(start, end, name, strings.ReplaceAll(err.Error(), " ", "_"))
	}
}

func (l *load) report(start, end int64, name, what string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fmt.Printf("FAIL %d %d %s %s\n", start, end, name, what)
}

func (l *load) summary() {
	if l.raw {
		fmt.Printf("SUMMARY sent=%d ok=%d wrong=%d nxdomain=%d failed=%d servfail=%d lost=%d wrongsrc=%d\n",
			l.sent.Load(), l.ok.Load(), l.wrong.Load(), l.nx.Load(), l.servfail.Load()+l.lost.Load(), l.servfail.Load(), l.lost.Load(), l.wrongSrc.Load())
		return
	}
	fmt.Printf("SUMMARY sent=%d ok=%d wrong=%d nxdomain=%d failed=%d\n", l.sent.Load(), l.ok.Load(), l.wrong.Load(), l.nx.Load(), l.failed.Load())
}

// exchangeUnconnected is exchange from an unconnected socket: it reads until a
// reply from server arrives or timeout passes, and returns the sources of the
// replies that came from elsewhere.
func exchangeUnconnected(server, name string, want netip.Addr, timeout time.Duration) (string, []string) {
	dst, err := net.ResolveUDPAddr("udp", server)
	if err != nil {
		return "wrong:" + strings.ReplaceAll(err.Error(), " ", "_"), nil
	}
	c, err := net.ListenUDP("udp", nil)
	if err != nil {
		return "wrong:" + strings.ReplaceAll(err.Error(), " ", "_"), nil
	}
	defer c.Close()
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), dns.TypeA)
	b, _ := m.Pack()
	if _, err := c.WriteToUDP(b, dst); err != nil {
		return "wrong:" + strings.ReplaceAll(err.Error(), " ", "_"), nil
	}
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	var strays []string
	buf := make([]byte, 4096)
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return "lost", strays
		}
		if from.Addr().Unmap() != dst.AddrPort().Addr().Unmap() || from.Port() != dst.AddrPort().Port() {
			strays = append(strays, from.String())
			continue
		}
		r := new(dns.Msg)
		if err := r.Unpack(buf[:n]); err != nil || r.Id != m.Id {
			continue
		}
		return judge(r, want), strays
	}
}

// exchange sends one A query for name on a fresh connected UDP socket and says
// what came back: ok, servfail, nxdomain, lost (nothing within timeout),
// wrong:<what>.
func exchange(server, name string, want netip.Addr, timeout time.Duration) string {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), dns.TypeA)
	c := &dns.Client{Net: "udp", Timeout: timeout}
	r, _, err := c.Exchange(m, server)
	if err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return "lost"
		}
		return "wrong:" + strings.ReplaceAll(err.Error(), " ", "_")
	}
	return judge(r, want)
}

// judge says what an answer is: ok, servfail, nxdomain or wrong:<what>.
func judge(r *dns.Msg, want netip.Addr) string {
	switch {
	case r.Rcode == dns.RcodeServerFailure:
		return "servfail"
	case r.Rcode == dns.RcodeNameError:
		return "nxdomain"
	case r.Rcode != dns.RcodeSuccess:
		return "wrong:" + dns.RcodeToString[r.Rcode]
	}
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ip, _ := netip.AddrFromSlice(a.A); ip.Unmap() == want {
				return "ok"
			}
			return "wrong:" + a.A.String()
		}
	}
	return "wrong:no_answer"
}
