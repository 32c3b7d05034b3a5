// Command goload is dnsload (testdata/dnsload) with Go's own resolver: it
// resolves name=ip targets in turn at a fixed total rate from several
// goroutines until SIGTERM or -d, one net.Resolver lookup (A only) per call
// (a name with "%d" gets a new number each time), and prints every lookup that did not return the expected address as
//
//	FAIL <start ns> <end ns> <name> <what>
//
// (CLOCK_MONOTONIC), then SUMMARY sent=N ok=N wrong=N nxdomain=N failed=N.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

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

func main() {
	rate := flag.Float64("r", 100, "lookups per second, in total")
	workers := flag.Int("t", 8, "goroutines")
	dur := flag.Duration("d", time.Hour, "how long")
	flag.Parse()
	var targets []target
	for _, a := range flag.Args() {
		name, ip, ok := strings.Cut(a, "=")
		want, err := netip.ParseAddr(ip)
		if !ok || err != nil {
			fmt.Fprintf(os.Stderr, "goload: bad target %s\n", a)
			os.Exit(2)
		}
		targets = append(targets, target{name, want})
	}
	if len(targets) == 0 {
		fmt.Fprintln(os.Stderr, "goload: need name=ip arguments")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *dur)
	defer cancel()
	var sent, ok, wrong, nx, failed atomic.Int64
	var mu sync.Mutex
	report := func(start, end int64, name, what string) {
		mu.Lock()
		fmt.Printf("FAIL %d %d %s %s\n", start, end, name, what)
		mu.Unlock()
	}
	fmt.Printf("START %d\n", monotonic())
	interval := time.Duration(float64(time.Second) * float64(*workers) / *rate)
	var wg sync.WaitGroup
	for w := range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			next := time.Now().Add(interval * time.Duration(w) / time.Duration(*workers))
			for i := w; ctx.Err() == nil; i++ {
				time.Sleep(time.Until(next))
				next = next.Add(interval)
				t := targets[i%len(targets)]
				name := t.name
				if strings.Contains(name, "%d") {
					name = fmt.Sprintf(name, w*100000000+i)
				}
				start := monotonic()
				// A Resolver per lookup: one Resolver merges concurrent lookups of a
				// name into one query (singleflight), which would count one lost
				// query as many failed lookups. Not bound to ctx: a lookup in flight
				// at the stop finishes.
				r := &net.Resolver{PreferGo: true}
				ips, err := r.LookupNetIP(context.Background(), "ip4", name)
				end := monotonic()
				sent.Add(1)
				var dnsErr *net.DNSError
				switch {
				case err == nil && len(ips) > 0 && ips[0].Unmap() == t.want:
					ok.Add(1)
				case err == nil:
					wrong.Add(1)
					report(start, end, name, fmt.Sprintf("wrong:%v", ips))
				case errors.As(err, &dnsErr) && dnsErr.IsNotFound:
					nx.Add(1)
					report(start, end, name, "nxdomain")
				default:
					failed.Add(1)
					report(start, end, name, strings.ReplaceAll(err.Error(), " ", "_"))
				}
			}
		}()
	}
	wg.Wait()
	fmt.Printf("SUMMARY sent=%d ok=%d wrong=%d nxdomain=%d failed=%d\n", sent.Load(), ok.Load(), wrong.Load(), nx.Load(), failed.Load())
}
