//go:build linux

package testenv

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

// Internet stands for the world outside a node in a network namespace of the
// test: every address of a prefix (198.18.0.0/15, the benchmarking range, in the
// egress tests) is local there, and one port accepts TCP connections (closing
// them at once) and echoes UDP datagrams, whichever address they were sent to.
type Internet struct {
	Prefix netip.Prefix
	Port   int

	accepted, echoed atomic.Int64
}

// StartInternet makes every address of prefix local in ns (a "local" route on
// lo) and serves port on all of them until the test ends. The node reaches it
// through a route the caller adds.
func StartInternet(t testing.TB, ns *Netns, prefix netip.Prefix, port int) *Internet {
	t.Helper()
	ns.IP(t, "route", "add", "local", prefix.String(), "dev", "lo")
	var in *Internet
	var stop func()
	err := ns.Do(func() error {
		var err error
		in, stop, err = ServeInternet(prefix, port)
		return err
	})
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(stop)
	return in
}

// ServeInternet serves port (TCP accepts, UDP echoes) on every local address
// of the calling thread's network namespace until stop is called; the caller
// makes prefix local there. StartInternet runs it in a test's namespace, the
// benchmark's helper (bench/cmd/benchrun) in its own.
func ServeInternet(prefix netip.Prefix, port int) (in *Internet, stop func(), err error) {
	in = &Internet{Prefix: prefix, Port: port}
	var ln net.Listener
	var pc *net.UDPConn
	err = func() error {
		var err error
		if ln, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port)); err != nil {
			return err
		}
		if pc, err = net.ListenUDP("udp4", &net.UDPAddr{Port: port}); err != nil {
			return err
		}
		// The echo leaves from the address the datagram was sent to (IP_PKTINFO),
		// so a connected client takes it.
		rc, err := pc.SyscallConn()
		if err != nil {
			return err
		}
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
		}); err != nil {
			return err
		}
		return serr
	}()
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		if pc != nil {
			pc.Close()
		}
		return nil, nil, fmt.Errorf("internet on %s port %d: %w", prefix, port, err)
	}
	go in.accept(ln)
	go in.echo(pc)
	return in, func() { ln.Close(); pc.Close() }, nil
}

func (in *Internet) accept(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		in.accepted.Add(1)
		c.Close()
	}
}

func (in *Internet) echo(pc *net.UDPConn) {
	buf := make([]byte, 1500)
	oob := make([]byte, 128)
	for {
		n, oobn, _, from, err := pc.ReadMsgUDPAddrPort(buf, oob)
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			continue
		}
		in.echoed.Add(1)
		pc.WriteMsgUDPAddrPort(buf[:n], replyFrom(oob[:oobn]), from) //nolint:errcheck // a lost echo is the client's timeout
	}
}

// replyFrom turns a received IP_PKTINFO into the one that sends from the
// datagram's destination address.
func replyFrom(oob []byte) []byte {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	for _, m := range msgs {
		if m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo {
			var info unix.Inet4Pktinfo
			copy(info.Spec_dst[:], m.Data[8:12]) // ipi_addr: the destination
			return unix.PktInfo4(&info)
		}
	}
	return nil
}

// Accepted is how many TCP connections arrived; Echoed how many UDP datagrams.
func (in *Internet) Accepted() int64 { return in.accepted.Load() }
func (in *Internet) Echoed() int64   { return in.echoed.Load() }

// freshName answers one name with a new address of its prefix on every query.
type freshName struct {
	prefix netip.Prefix
	ttl    uint32
	next   atomic.Uint32
}

// addr is the n-th address of the prefix, skipping the network address.
func (f *freshName) addr() netip.Addr {
	n := f.next.Add(1)
	a := f.prefix.Masked().Addr().As4()
	host := uint32(1) << (32 - f.prefix.Bits())
	v := (uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])) + 1 + (n-1)%(host-2)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// SetFresh makes the server answer A queries for name with a new address of
// prefix (IPv4) on every query, with ttl: a name whose every answer names an
// address no earlier answer did.
func (f *FakeDNS) SetFresh(name string, prefix netip.Prefix, ttl uint32) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fresh[dns.CanonicalName(name)] = &freshName{prefix: prefix, ttl: ttl}
}

// freshAnswer answers req if its name was set with SetFresh.
func (f *FakeDNS) freshAnswer(req *dns.Msg) (*dns.Msg, bool) {
	if len(req.Question) != 1 {
		return nil, false
	}
	q := req.Question[0]
	f.mu.Lock()
	fr := f.fresh[dns.CanonicalName(q.Name)]
	f.mu.Unlock()
	if fr == nil {
		return nil, false
	}
	resp := new(dns.Msg)
	resp.SetReply(req)
	resp.RecursionAvailable = true
	if q.Qtype == dns.TypeA {
		resp.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: fr.ttl}, A: fr.addr().AsSlice()}}
	}
	return resp, true
}
