package handover

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
)

// The handover protocol between a running agent and its successor, over the real handover socket in a temporary state directory.
// Neither side is a whole agent: the predecessor's side is scripted per test
// (what a real one sends, or a misbehaving one), the successor's is
// Request; and the other way round for SendOffer. No privilege is
// needed: the descriptors are loopback sockets and a lock file.

// predecessor listens on dir's handover socket and runs script on the first
// connection; it returns the script's result.
func predecessor(t *testing.T, dir string, script func(c *net.UnixConn) error) <-chan error {
	t.Helper()
	l, err := Listen(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	done := make(chan error, 1)
	go func() {
		c, err := l.AcceptUnix()
		if err != nil {
			done <- err
			return
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		err = script(c)
		c.Close()
		done <- err
	}()
	return done
}

// offerFiles is what a running agent offers: its lock, admin and local
// listeners, and one listen address's resolver sockets (udp UDP sockets,
// one TCP listener), all on loopback.
type offerFiles struct {
	o        Offer
	udpAddr  string // the UDP sockets' address
	tcpAddr  string
	adminTCP string
}

func newOfferFiles(t *testing.T, dir string, udp int) *offerFiles {
	t.Helper()
	lock, err := agentstate.TryLock(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lock.Release() })
	of := &offerFiles{o: Offer{Lock: lock.File(), State: &agentstate.State{PID: os.Getpid(), Mode: agentstate.ModeEBPF, Listen: []string{"127.0.0.1:53"}}}}
	file := func(f interface{ File() (*os.File, error) }) *os.File {
		t.Helper()
		fl, err := f.File()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { fl.Close() })
		return fl
	}
	pc, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	of.udpAddr = pc.LocalAddr().String()
	tl, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tl.Close() })
	of.tcpAddr = tl.Addr().String()
	al, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { al.Close() })
	of.adminTCP = al.Addr().String()
	ll, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "local.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ll.Close() })
	il := resolver.InheritedListener{Addr: "127.0.0.1:53", TCP: file(tl)}
	for range udp {
		il.UDP = append(il.UDP, file(pc)) // each a descriptor of the same socket
	}
	of.o.Listeners = []resolver.InheritedListener{il}
	of.o.Admin, of.o.Local = file(al), file(ll)
	return of
}

// request is Request of dir's agent, as a successor asks.
func request(t *testing.T, dir string) (*Inheritance, error) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	return Request(ctx, dir)
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func expectHello(c *net.UnixConn) error {
	hello, files, err := readMsg(c)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		return err
	}
	if hello.Op != "hello" || hello.PID != os.Getpid() {
		return errors.New("not a hello from this pid: " + hello.Op)
	}
	return nil
}

func TestHandoverExchange(t *testing.T) {
	for _, udp := range []int{2, maxFDsPerMessage + 10} { // one message; descriptors in chunks
		t.Run(map[bool]string{true: "descriptors in chunks", false: "one message"}[udp > maxFDsPerMessage], func(t *testing.T) {
			dir := t.TempDir()
			of := newOfferFiles(t, dir, udp)
			succ := make(chan int, 1)
			done := predecessor(t, dir, func(c *net.UnixConn) error {
				if err := expectHello(c); err != nil {
					return err
				}
				pid, err := SendOffer(c, of.o)
				succ <- pid
				return err
			})
			in, err := request(t, dir)
			if err != nil {
				t.Fatalf("Request: %v", err)
			}
			defer in.CloseUnused()
			defer in.Lock.Release()
			if in.From != os.Getpid() || in.State == nil || in.State.Mode != agentstate.ModeEBPF || in.State.Listen[0] != "127.0.0.1:53" {
				t.Errorf("inherited from pid %d state %+v, want pid %d and the offered state", in.From, in.State, os.Getpid())
			}
			// Every descriptor arrives in its place: the same sockets.
			if len(in.Listeners) != 1 || len(in.Listeners[0].UDP) != udp || in.Listeners[0].TCP == nil || in.Listeners[0].Addr != "127.0.0.1:53" {
				t.Fatalf("listeners %+v, want one with %d UDP sockets and a TCP listener", in.Listeners, udp)
			}
			for i, f := range []*os.File{in.Listeners[0].UDP[0], in.Listeners[0].UDP[udp-1]} {
				pc, err := net.FilePacketConn(f)
				if err != nil {
					t.Fatal(err)
				}
				if got := pc.LocalAddr().String(); got != of.udpAddr {
					t.Errorf("UDP socket %d at %s, want %s", i, got, of.udpAddr)
				}
				pc.Close()
			}
			for _, c := range []struct {
				name string
				f    *os.File
				want string
			}{{"TCP listener", in.Listeners[0].TCP, of.tcpAddr}, {"admin listener", in.admin, of.adminTCP}, {"local listener", in.local, filepath.Join(dir, "local.sock")}} {
				if c.f == nil {
					t.Errorf("no %s", c.name)
					continue
				}
				l, err := net.FileListener(c.f)
				if err != nil {
					t.Fatalf("%s: %v", c.name, err)
				}
				if got := l.Addr().String(); got != c.want {
					t.Errorf("%s at %s, want %s", c.name, got, c.want)
				}
				l.Close()
			}
			// The lock descriptor is the predecessor's open lock file: it is held.
			if _, err := agentstate.TryLock(dir); !errors.Is(err, agentstate.ErrLocked) {
				t.Errorf("tryLock while both hold the lock: %v, want agentstate.ErrLocked", err)
			}
			if err := in.Serving(); err != nil {
				t.Fatalf("serving: %v", err)
			}
			if err := <-done; err != nil {
				t.Fatalf("predecessor: %v", err)
			}
			if pid := <-succ; pid != os.Getpid() {
				t.Errorf("predecessor heard serving from pid %d, want %d", pid, os.Getpid())
			}
		})
	}
}

// A predecessor that refuses, answers garbage or dies before or during its
// offer leaves the successor with ErrRetry (it tries again, or starts cold
// once the lock is free) and no descriptor of the predecessor's open.
func TestHandoverPredecessorFails(t *testing.T) {
	for _, tc := range []struct {
		name   string
		script func(c *net.UnixConn, of *offerFiles) error
		want   string
	}{
		{"refuses", func(c *net.UnixConn, _ *offerFiles) error {
			return writeMsg(c, handoverMsg{Op: "error", Error: "not ready"}, nil)
		}, "declined: not ready"},
		{"garbled", func(c *net.UnixConn, _ *offerFiles) error {
			_, _, err := c.WriteMsgUnix([]byte("{not json"), nil, nil)
			return err
		}, "handover message"},
		{"dies before its offer", func(c *net.UnixConn, _ *offerFiles) error {
			return nil // the connection closes
		}, "read the offer"},
		{"dies between chunks", func(c *net.UnixConn, of *offerFiles) error {
			m, fds, err := of.o.message()
			if err != nil {
				return err
			}
			return writeMsg(c, m, fds[:maxFDsPerMessage]) // and no more
		}, "read descriptors"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			of := newOfferFiles(t, dir, maxFDsPerMessage+10)
			done := predecessor(t, dir, func(c *net.UnixConn) error {
				if err := expectHello(c); err != nil {
					return err
				}
				return tc.script(c, of)
			})
			before := openFDs(t)
			in, err := request(t, dir)
			if err == nil {
				in.CloseUnused()
				t.Fatal("Request succeeded")
			}
			if !errors.Is(err, ErrRetry) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Request: %v, want ErrRetry about %q", err, tc.want)
			}
			if err := <-done; err != nil {
				t.Fatalf("predecessor: %v", err)
			}
			// The predecessor closed its connection before it reported: what
			// stays open is the test's own, the successor kept nothing.
			if after := openFDs(t); after != before {
				t.Errorf("%d descriptors open after the failed handover, %d before", after, before)
			}
		})
	}
}

// No agent listening (not started yet, or gone) is ErrRetry too.
func TestHandoverNobodyListening(t *testing.T) {
	_, err := Request(t.Context(), t.TempDir())
	if !errors.Is(err, ErrRetry) || !strings.Contains(err.Error(), "connect") {
		t.Errorf("Request without a listener: %v, want ErrRetry about connect", err)
	}
}

// A successor that dies after taking the descriptors, or answers anything but
// "serving", leaves the predecessor with an error: it serves on (reassert).
func TestHandoverSuccessorFails(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reply func(in *Inheritance) error
		want  string
	}{
		{"dies before serving", func(in *Inheritance) error { return in.conn.Close() }, "did not start"},
		{"garbled", func(in *Inheritance) error {
			_, _, err := in.conn.WriteMsgUnix([]byte("\x00\x01"), nil, nil)
			return err
		}, "handover message"},
		{"reports an error", func(in *Inheritance) error {
			return writeMsg(in.conn, handoverMsg{Op: "error", Error: "no datapath"}, nil)
		}, "error no datapath"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			of := newOfferFiles(t, dir, 2)
			done := predecessor(t, dir, func(c *net.UnixConn) error {
				if err := expectHello(c); err != nil {
					return err
				}
				_, err := SendOffer(c, of.o)
				return err
			})
			in, err := request(t, dir)
			if err != nil {
				t.Fatalf("Request: %v", err)
			}
			in.CloseUnused()
			in.Lock.Release()
			if err := tc.reply(in); err != nil {
				t.Fatal(err)
			}
			err = <-done
			in.conn.Close()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("SendOffer: %v, want an error about %q", err, tc.want)
			}
		})
	}
}

// An offer whose descriptors do not add up is refused whole.
func TestUnpackOfferRefusesMissingDescriptors(t *testing.T) {
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, m := range []handoverMsg{
		{Op: "offer", State: &agentstate.State{}, FDs: 2},
		{Op: "offer", FDs: 1},
		{Op: "offer", State: &agentstate.State{}, FDs: 1, Listeners: []handoverListener{{Addr: "127.0.0.1:53", UDP: 1}}},
	} {
		if _, err := unpackOffer(m, []*os.File{f}); err == nil {
			t.Errorf("unpackOffer(%+v) with one descriptor succeeded", m)
		}
	}
}
