//go:build linux

package ctzonetest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// HelperEnv selects a helper main in a re-executed test binary: "proxy" or "app".
const HelperEnv = "MESHDNS_CTZONETEST_HELPER"

// MaybeRunHelper runs the helper main selected by HelperEnv and exits; it
// returns at once when HelperEnv is unset. Call it first in TestMain of every
// test binary that uses this package.
func MaybeRunHelper() {
	var err error
	switch os.Getenv(HelperEnv) {
	case "":
		return
	case "proxy":
		err = proxyMain(os.Args[1:])
	case "app":
		err = appMain(os.Args[1:])
	default:
		err = fmt.Errorf("unknown helper %q", os.Getenv(HelperEnv))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// proxyMain is the stand-in of a sidecar DNS proxy (Istio's agent): it answers
// names under -suffix itself and forwards everything else to -upstream, each
// query over a new connected UDP socket with an ephemeral source port, marked
// with -mark when non-zero.
func proxyMain(args []string) error {
	fs := flag.NewFlagSet("proxy", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:15053", "UDP+TCP listen address")
	upstream := fs.String("upstream", "", "upstream nameserver ip:port")
	mark := fs.Uint("mark", 0, "SO_MARK of upstream sockets")
	suffix := fs.String("suffix", "mesh.test.", "names answered locally")
	answer := fs.String("answer", "240.240.0.1", "A record of local names")
	register := fs.String("register", "", "pin directory of an eBPF datapath to register the listening sockets with")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ip := net.ParseIP(*answer)
	dialer := &net.Dialer{Timeout: 2 * time.Second}
	if *mark != 0 {
		m := int(*mark)
		dialer.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, m) }); err != nil {
				return err
			}
			return serr
		}
	}
	client := &dns.Client{Net: "udp", Timeout: 2 * time.Second, Dialer: dialer}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		resp := new(dns.Msg)
		if len(req.Question) != 1 {
			resp.SetRcode(req, dns.RcodeFormatError)
			_ = w.WriteMsg(resp)
			return
		}
		q := req.Question[0]
		if dns.IsSubDomain(*suffix, dns.CanonicalName(q.Name)) {
			resp.SetReply(req)
			resp.Authoritative = true
			if q.Qtype == dns.TypeA {
				resp.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 30}, A: ip}}
			}
			_ = w.WriteMsg(resp)
			return
		}
		up, _, err := client.Exchange(req, *upstream)
		if err != nil {
			resp.SetRcode(req, dns.RcodeServerFailure)
			_ = w.WriteMsg(resp)
			return
		}
		_ = w.WriteMsg(up)
	})
	pc, err := net.ListenPacket("udp", *listen)
	if err != nil {
		return err
	}
	var lc net.ListenConfig
	lc.SetMultipathTCP(false) // plain TCP: a datapath can register it
	ln, err := lc.Listen(context.Background(), "tcp", *listen)
	if err != nil {
		return err
	}
	var decorate dns.DecorateReader
	if *register != "" {
		addr := netip.MustParseAddrPort(*listen)
		reg, err := redirect.Register(*register, []redirect.Socket{
			{Addr: addr, Conn: pc.(*net.UDPConn)}, {Addr: addr, TCP: true, Conn: ln.(*net.TCPListener)}})
		if err != nil {
			return err
		}
		defer reg.Close()
		decorate = func(r dns.Reader) dns.Reader { return countingReader{r, reg.Dequeued} }
	}
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: handler, DecorateReader: decorate}, {Listener: ln, Handler: handler, DecorateReader: decorate}} {
		go func() { _ = s.ActivateAndServe() }()
	}
	fmt.Println("ready")
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	return nil
}

// countingReader tells count about every message read: the proxy's progress
// for the datapath it registered with.
type countingReader struct {
	dns.Reader
	count func(n int)
}

func (c countingReader) ReadUDP(conn *net.UDPConn, timeout time.Duration) ([]byte, *dns.SessionUDP, error) {
	b, s, err := c.Reader.ReadUDP(conn, timeout)
	if err == nil {
		c.count(1)
	}
	return b, s, err
}

func (c countingReader) ReadTCP(conn net.Conn, timeout time.Duration) ([]byte, error) {
	b, err := c.Reader.ReadTCP(conn, timeout)
	if err == nil {
		c.count(1)
	}
	return b, err
}

// AppResult is what the app helper saw.
type AppResult struct {
	Mesh          int            // mesh queries sent
	MeshOK        int            // answered by the proxy (AA, the mesh address)
	Misrouted     int            // answered NXDOMAIN: the query reached the upstream
	MeshLost      int            // no usable answer before the timeout
	MeshOther     int            // any other answer
	External      int            // external queries sent
	ExternalOK    int            // answered with the upstream's address
	ExternalFail  int            // anything else
	DialFailures  int            // sockets that found no free source port after retries
	Ports         map[uint16]int // source ports used, with how often
	FirstProblems []string       // up to 10 descriptions of failed queries
}

// appMain is the application: it sends -mesh queries for distinct mesh names,
// each followed by -external queries for -external-name, sequentially, each
// over a new connected UDP socket (as libc resolvers do) to -ns.
func appMain(args []string) error {
	fs := flag.NewFlagSet("app", flag.ContinueOnError)
	ns := fs.String("ns", "", "nameserver ip:port")
	mesh := fs.Int("mesh", 1000, "mesh queries")
	external := fs.Int("external", 1, "external queries after each mesh query")
	suffix := fs.String("suffix", "mesh.test.", "mesh domain")
	meshAnswer := fs.String("mesh-answer", "240.240.0.1", "expected mesh address")
	extName := fs.String("external-name", "www.example.test.", "external name")
	extAnswer := fs.String("external-answer", "192.0.2.10", "expected external address")
	timeout := fs.Duration("timeout", time.Second, "per-query timeout")
	if err := fs.Parse(args); err != nil {
		return err
	}
	wantMesh, wantExt := netip.MustParseAddr(*meshAnswer), netip.MustParseAddr(*extAnswer)
	res := AppResult{Ports: map[uint16]int{}}
	problem := func(format string, a ...any) {
		if len(res.FirstProblems) < 10 {
			res.FirstProblems = append(res.FirstProblems, fmt.Sprintf(format, a...))
		}
	}
	for i := 0; i < *mesh; i++ {
		name := fmt.Sprintf("svc-%d.ns.%s", i, *suffix)
		res.Mesh++
		resp, port, err := exchange(*ns, name, *timeout)
		switch {
		case errors.Is(err, errNoPort):
			res.DialFailures++
			res.MeshLost++
		case err != nil:
			res.MeshLost++
			problem("mesh %s from port %d: %v", name, port, err)
		case resp.Rcode == dns.RcodeNameError:
			res.Misrouted++
			problem("mesh %s from port %d: NXDOMAIN (misrouted to the upstream)", name, port)
		case resp.Rcode == dns.RcodeSuccess && resp.Authoritative && hasA(resp, wantMesh):
			res.MeshOK++
		default:
			res.MeshOther++
			problem("mesh %s from port %d: unexpected answer %s", name, port, dns.RcodeToString[resp.Rcode])
		}
		if port != 0 {
			res.Ports[port]++
		}
		for j := 0; j < *external; j++ {
			res.External++
			resp, port, err := exchange(*ns, *extName, *timeout)
			switch {
			case errors.Is(err, errNoPort):
				res.DialFailures++
				res.ExternalFail++
			case err == nil && resp.Rcode == dns.RcodeSuccess && hasA(resp, wantExt):
				res.ExternalOK++
			default:
				res.ExternalFail++
				if err == nil {
					err = fmt.Errorf("rcode %s", dns.RcodeToString[resp.Rcode])
				}
				problem("external from port %d: %v", port, err)
			}
			if port != 0 {
				res.Ports[port]++
			}
		}
	}
	w := bufio.NewWriter(os.Stdout)
	if err := json.NewEncoder(w).Encode(res); err != nil {
		return err
	}
	return w.Flush()
}

var errNoPort = errors.New("no free source port")

func hasA(m *dns.Msg, want netip.Addr) bool {
	for _, rr := range m.Answer {
		if a, ok := rr.(*dns.A); ok {
			if got, ok := netip.AddrFromSlice(a.A.To4()); ok && got == want {
				return true
			}
		}
	}
	return false
}

// exchange sends one A query over a new connected UDP socket and returns the
// answer and the source port used.
func exchange(ns, name string, timeout time.Duration) (*dns.Msg, uint16, error) {
	var conn net.Conn
	var err error
	for attempt := 0; attempt < 200; attempt++ {
		conn, err = net.Dial("udp", ns)
		if err == nil {
			break
		}
		time.Sleep(5 * time.Millisecond) // the narrow port range is momentarily used up
	}
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %v", errNoPort, err)
	}
	defer conn.Close()
	port := uint16(conn.LocalAddr().(*net.UDPAddr).Port)
	req := new(dns.Msg)
	req.SetQuestion(name, dns.TypeA)
	wire, err := req.Pack()
	if err != nil {
		return nil, port, err
	}
	if _, err := conn.Write(wire); err != nil {
		return nil, port, err
	}
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 4096)
	for {
		_ = conn.SetReadDeadline(deadline)
		n, err := conn.Read(buf)
		if err != nil {
			return nil, port, err
		}
		resp := new(dns.Msg)
		if err := resp.Unpack(buf[:n]); err != nil || resp.Id != req.Id {
			continue
		}
		return resp, port, nil
	}
}
