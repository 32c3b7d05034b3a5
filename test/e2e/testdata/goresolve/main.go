// Command goresolve resolves names with Go's pure resolver (it reads
// /etc/resolv.conf and checks nothing of the reply source), printing one address a
// line, or "NXDOMAIN" when the name does not exist.
package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"
)

func main() {
	r := &net.Resolver{PreferGo: true}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, name := range os.Args[1:] {
		addrs, err := r.LookupHost(ctx, name)
		var de *net.DNSError
		if errors.As(err, &de) && de.IsNotFound {
			fmt.Println("NXDOMAIN")
			continue
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "goresolve:", err)
			os.Exit(1)
		}
		for _, a := range addrs {
			fmt.Println(a)
		}
	}
}
