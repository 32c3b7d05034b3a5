//go:build linux

package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Helpers: benchrun runs itself as small clients inside the benchmark's
// network namespace and cgroups (`benchrun helper ...`, behind the same
// nsenter/cgroup prefixes as dnsperf), so what they do is charged to the
// right cgroup and never leaves that namespace.
//
//	helper tap read|stuck URL     subscribe to an agent's /debug/tap; print "subscribed"
//	                              once the stream is open; read: count records and
//	                              lost notices until SIGTERM, then print them;
//	                              stuck: never read again
//	helper get URL                print the body of URL
//	helper send udp|tcp ADDR DUR  send 64-byte datagrams (connected UDP) or a TCP
//	                              stream (64 KiB writes) to ADDR for DUR; print
//	                              packets (writes), bytes and own CPU nanoseconds
//	helper sink ADDR              accept TCP connections on ADDR, read and discard
//	helper internet PORT DNSADDR NAME PREFIX
//	                              the egress lane's internet and its nameserver (egress.go)
//	helper rusage ARGV...         run ARGV, then print its CPU (egress.go)
//	helper spin CPU                keep CPU from idling: a busy loop at SCHED_IDLE, which
//	                              any other task preempts at once (budgets.go)
//	helper quiet ADDR LOCAL PAUSE TIMEOUT NAME...
//	                              the budgets lane's quiet workload, a process of its
//	                              own (budgets.go): ask the names in turn from LOCAL
//	                              until stdin closes, then print the probe as JSON

// runHelper runs a helper and returns the exit code.
func runHelper(args []string) int {
	var err error
	switch {
	case len(args) == 3 && args[0] == "tap":
		err = helperTap(args[1], args[2])
	case len(args) == 2 && args[0] == "get":
		err = helperGet(args[1])
	case len(args) == 4 && args[0] == "send":
		var d time.Duration
		if d, err = time.ParseDuration(args[3]); err == nil {
			err = helperSend(args[1], args[2], d)
		}
	case len(args) == 2 && args[0] == "sink":
		err = helperSink(args[1])
	case len(args) == 5 && args[0] == "internet":
		err = helperInternet(args[1], args[2], args[3], args[4])
	case len(args) > 1 && args[0] == "rusage":
		err = helperRusage(args[1:])
	case len(args) == 2 && args[0] == "spin":
		err = helperSpin(args[1])
	case len(args) > 5 && args[0] == "quiet":
		err = helperQuiet(args[1], args[2], args[3], args[4], args[5:])
	default:
		err = fmt.Errorf("unknown helper %q", args)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchrun helper:", err)
		return 1
	}
	return 0
}

// helperTap is a tap subscriber: one that reads everything, or one that is stuck.
func helperTap(mode, url string) error {
	if mode != "read" && mode != "stuck" {
		return fmt.Errorf("tap mode %q: want read or stuck", mode)
	}
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	fmt.Println("subscribed")
	if mode == "stuck" {
		<-term // never read: the agent's writes fill the socket, then its ring
		return nil
	}
	var records, lost uint64
	done := make(chan error, 1)
	go func() {
		br := bufio.NewReaderSize(resp.Body, 1<<20)
		for {
			line, err := br.ReadSlice('\n')
			if err != nil && !errors.Is(err, bufio.ErrBufferFull) {
				done <- err
				return
			}
			if n, ok := bytes.CutPrefix(line, []byte(`{"lost":`)); ok {
				v, _ := strconv.ParseUint(string(bytes.TrimRight(n, "}\n")), 10, 64)
				lost += v
			} else {
				records++
			}
		}
	}()
	select {
	case <-term:
	case err := <-done:
		fmt.Fprintln(os.Stderr, "benchrun helper: tap stream ended:", err)
	}
	fmt.Printf("records %d lost %d\n", records, lost)
	return nil
}

func helperGet(url string) error {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}

// helperSend sends for d from one thread and reports what it sent and the CPU
// it used (the whole process: the Go runtime adds little to a thread blocked
// in nothing but write(2)).
func helperSend(proto, addr string, d time.Duration) error {
	runtime.LockOSThread()
	size := 64
	if proto == "tcp" {
		size = 64 << 10
	} else if proto != "udp" {
		return fmt.Errorf("send %q: want udp or tcp", proto)
	}
	c, err := net.Dial(proto, addr)
	if err != nil {
		return err
	}
	defer c.Close()
	raw, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		return err
	}
	buf := make([]byte, size)
	var pkts, bytes uint64
	var ru0, ru1 unix.Rusage
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru0)
	start := time.Now()
	var werr error
	err = raw.Write(func(fd uintptr) bool {
		for time.Since(start) < d {
			for range 64 { // check the clock every 64 writes
				n, err := unix.Write(int(fd), buf)
				if err != nil {
					if err == unix.EAGAIN {
						return false // let the poller wait (TCP: the receiver is behind)
					}
					werr = err
					return true
				}
				pkts++
				bytes += uint64(n)
			}
		}
		return true
	})
	elapsed := time.Since(start)
	_ = unix.Getrusage(unix.RUSAGE_SELF, &ru1)
	if err == nil {
		err = werr
	}
	if err != nil {
		return err
	}
	cpu := tvNS(ru1.Utime) + tvNS(ru1.Stime) - tvNS(ru0.Utime) - tvNS(ru0.Stime)
	fmt.Printf("packets %d bytes %d cpu_ns %d wall_ns %d\n", pkts, bytes, cpu, elapsed.Nanoseconds())
	return nil
}

func tvNS(t unix.Timeval) int64 { return t.Sec*1e9 + t.Usec*1e3 }

// helperSink accepts TCP connections and discards what they send.
func helperSink(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	fmt.Println("listening")
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		go func() {
			defer c.Close()
			_, _ = io.Copy(io.Discard, c)
		}()
	}
}
