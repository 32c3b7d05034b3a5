//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/bench/internal/meshdata"
)

// peer is one server under test.
type peer struct {
	name string
	desc string
	port int
	// argv returns the command line (without the taskset prefix); an error means the
	// peer is not available and is skipped with that reason.
	argv func() ([]string, error)
	env  []string
}

// proc is a running server.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
	err  error
}

// pid of the server process itself (taskset execs it).
func (p *proc) pid() int { return p.cmd.Process.Pid }

// start runs argv pinned to cpu with output in logDir/<name>.log.
func start(name string, cpu int, argv []string, env []string, logDir string) (*proc, error) {
	logPath := filepath.Join(logDir, name+".log")
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("create log %s: %w", logPath, err)
	}
	full := append([]string{"taskset", "-c", strconv.Itoa(cpu)}, argv...)
	cmd := exec.Command(full[0], full[1:]...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	fmt.Fprintf(lf, "# %q\n", full)
	if err := cmd.Start(); err != nil {
		lf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: lf, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the server's process group, then SIGKILL after 5 s.
func (p *proc) stop() {
	defer p.log.Close()
	if p.exited() {
		return
	}
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// exchange sends one UDP query to addr.
func exchange(addr, name string, qtype uint16) (*dns.Msg, error) {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	m.RecursionDesired = true
	c := &dns.Client{Net: "udp", Timeout: 500 * time.Millisecond}
	r, _, err := c.Exchange(m, addr)
	return r, err
}

// firstA is the first A answer in r.
func firstA(r *dns.Msg) (netip.Addr, bool) {
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			ip, ok := netip.AddrFromSlice(a.A)
			return ip.Unmap(), ok
		}
	}
	return netip.Addr{}, false
}

// waitAnswer polls addr until name resolves to want (A), p exits or ctx ends.
func waitAnswer(ctx context.Context, p *proc, addr, name string, want netip.Addr) error {
	return poll(ctx, p, addr, name, func(r *dns.Msg) error {
		if got, ok := firstA(r); ok && got == want {
			return nil
		}
		return fmt.Errorf("%s A: rcode %s, answer %v, want %s", name, dns.RcodeToString[r.Rcode], r.Answer, want)
	})
}

// waitReply waits until the server at addr answers a query at all (any
// answer with the query's ID: the echo server has no records).
func waitReply(ctx context.Context, p *proc, addr string) error {
	return poll(ctx, p, addr, "echo.example.", func(*dns.Msg) error { return nil })
}

// poll asks addr for name (A) every 50 ms until accept takes the reply, p
// (if any) exits or ctx ends; the error says what the last attempt got.
func poll(ctx context.Context, p *proc, addr, name string, accept func(*dns.Msg) error) error {
	var last error
	for {
		r, err := exchange(addr, name, dns.TypeA)
		if err == nil {
			err = accept(r)
		}
		if last = err; last == nil {
			return nil
		}
		if p != nil && p.exited() {
			return fmt.Errorf("%s exited (%v); see its log", p.name, p.err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready: %w (last: %v)", ctx.Err(), last)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// check is one correctness probe; every peer must give the same answers.
type check struct {
	what  string
	name  string
	qtype uint16
	// ok judges the reply.
	ok func(r *dns.Msg) bool
}

func checks(tab meshdata.Table) []check {
	svc := tab.Services[0]
	ext := meshdata.ExternalName(0)
	rcode := func(want int) func(*dns.Msg) bool {
		return func(r *dns.Msg) bool { return r.Rcode == want }
	}
	return []check{
		{"in-table A", svc.FQDN(), dns.TypeA, func(r *dns.Msg) bool {
			ip, ok := firstA(r)
			return r.Rcode == dns.RcodeSuccess && ok && ip == svc.IP
		}},
		{"in-table AAAA = NODATA", svc.FQDN(), dns.TypeAAAA, func(r *dns.Msg) bool {
			return r.Rcode == dns.RcodeSuccess && len(r.Answer) == 0
		}},
		{"mesh-zone miss = NXDOMAIN", "nope." + svc.Namespace + ".svc." + meshdata.Zone, dns.TypeA, rcode(dns.RcodeNameError)},
		// A search-expanded name: NXDOMAIN, or an autopath-style CNAME to the real name.
		{"search-expanded = NXDOMAIN|autopath", svc.FQDN() + svc.Namespace + ".svc." + meshdata.Zone, dns.TypeA, func(r *dns.Msg) bool {
			if r.Rcode == dns.RcodeNameError {
				return true
			}
			ip, ok := firstA(r)
			return r.Rcode == dns.RcodeSuccess && ok && ip == svc.IP
		}},
		{"forwarded A", ext, dns.TypeA, func(r *dns.Msg) bool {
			ip, ok := firstA(r)
			return r.Rcode == dns.RcodeSuccess && ok && ip == meshdata.ExternalIP(ext)
		}},
		{"forwarded NXDOMAIN", "x." + meshdata.NXSuffix, dns.TypeA, rcode(dns.RcodeNameError)},
	}
}

// runChecks returns the failed probes.
func runChecks(addr string, cs []check) []string {
	var failed []string
	for _, c := range cs {
		r, err := exchange(addr, c.name, c.qtype)
		switch {
		case err != nil:
			failed = append(failed, fmt.Sprintf("%s: %v", c.what, err))
		case !c.ok(r):
			failed = append(failed, fmt.Sprintf("%s: got rcode %s, %d answers", c.what, dns.RcodeToString[r.Rcode], len(r.Answer)))
		}
	}
	return failed
}

var errSkip = errors.New("skipped")
