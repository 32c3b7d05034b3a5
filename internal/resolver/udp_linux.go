//go:build linux

package resolver

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The Linux UDP transport. Each listen address has one SO_REUSEPORT socket per CPU,
// and each socket one reader goroutine that blocks in
// recvmmsg(2) (the socket is in blocking mode, outside Go's netpoller; the call is a raw
// system call, so the reader keeps its scheduler P: see Server.Start), answers what it
// received through the query path, and sends the answers with one sendmmsg(2). An idle
// reader wakes every receive timeout (250 ms) to notice a stop, so a drain works even
// when the socket stays open in another process (closing an fd does not wake a thread
// blocked on it). The goroutine is locked to its thread only when Config.ReaderNice
// asks for the thread's priority to be raised; otherwise nothing in it is
// thread-bound, and when the runtime preempts it (every 10 ms of uninterrupted work)
// any thread may resume it without a hand-off. Because the socket has a receive timeout, a signal interrupts the
// call with EINTR instead of restarting it: the runtime's preemption and
// stop-the-world signals reach the reader at once, which then yields (runtime.Gosched).

// reusePortSupported: one UDP socket per CPU shares the address through
// SO_REUSEPORT and the kernel spreads packets over them.
const reusePortSupported = true

const (
	udpRcvBuf     = 4 << 20 // receive buffer asked for on each UDP socket (capped by rmem_max)
	udpRcvTimeout = 250 * time.Millisecond
	udpBatch      = 16   // messages per recvmmsg/sendmmsg
	udpRxSize     = 4096 // largest query read; longer datagrams are cut (and fail to parse)
	oobSize       = 64
)

// udpSock is one bound UDP socket.
type udpSock struct {
	fd      int
	pktinfo bool // wildcard address: replies name their source address
	v4      bool
	// mu orders late answers (udpReply.send) before close: once closed, the fd number
	// may belong to another socket and must not be written to.
	mu     sync.RWMutex
	closed bool
}

func (u *udpSock) close() {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.closed {
		u.closed = true
		_ = unix.Close(u.fd)
	}
}

func (u *udpSock) localIP() string {
	sa, err := unix.Getsockname(u.fd)
	if err != nil {
		return ""
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrFrom4(a.Addr).String()
	case *unix.SockaddrInet6:
		return netip.AddrFrom16(a.Addr).String()
	}
	return ""
}

// bindUDP creates a blocking UDP socket with SO_REUSEPORT bound to host:port ("" =
// every address, dual-stack where IPv6 exists) and returns it with its bound port.
func bindUDP(host string, port int) (*udpSock, int, error) {
	var ip netip.Addr
	if host != "" {
		ip, _ = netip.ParseAddr(host)
	}
	family := unix.AF_INET6
	if ip.Is4() || (!ip.IsValid() && !haveIPv6()) {
		family = unix.AF_INET
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("socket: %w", err)
	}
	u := &udpSock{fd: fd, v4: family == unix.AF_INET}
	fail := func(what string, err error) (*udpSock, int, error) {
		unix.Close(fd)
		return nil, 0, fmt.Errorf("%s: %w", what, err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
		return fail("SO_REUSEPORT", err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, udpRcvBuf) // best effort
	tv := unix.NsecToTimeval(int64(udpRcvTimeout))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fail("SO_RCVTIMEO", err)
	}
	var sa unix.Sockaddr
	if family == unix.AF_INET {
		sa = &unix.SockaddrInet4{Port: port, Addr: ip.Unmap().As4()}
	} else {
		if !ip.IsValid() {
			if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
				return fail("IPV6_V6ONLY", err)
			}
		}
		sa = &unix.SockaddrInet6{Port: port, Addr: ip.As16()}
	}
	if !ip.IsValid() || ip.IsUnspecified() {
		u.pktinfo = true
		if family == unix.AF_INET {
			err = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
		} else {
			// Also reports IPv4 packets of a dual-stack socket (mapped).
			err = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1)
		}
		if err != nil {
			return fail("packet info", err)
		}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return fail("bind "+net.JoinHostPort(host, fmt.Sprint(port)), err)
	}
	got, err := unix.Getsockname(fd)
	if err != nil {
		return fail("getsockname", err)
	}
	switch a := got.(type) {
	case *unix.SockaddrInet4:
		port = a.Port
	case *unix.SockaddrInet6:
		port = a.Port
	}
	return u, port, nil
}

func haveIPv6() bool {
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	unix.Close(fd)
	return true
}

// listenTCP listens with SO_REUSEPORT (a successor can bind beside us).
func listenTCP(addr string) (net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	lc.SetMultipathTCP(false) // plain TCP: see handover.go
	return lc.Listen(context.Background(), "tcp", addr)
}

// mmsghdr is struct mmsghdr of recvmmsg(2)/sendmmsg(2).
type mmsghdr struct {
	hdr unix.Msghdr
	n   uint32
	_   [4]byte
}

// udpReply is where a later UDP answer goes: the socket, the client's address as
// received and the packet-info control message naming our source address.
type udpReply struct {
	sock    *udpSock
	name    unix.RawSockaddrInet6 // large enough for both families
	namelen uint32
	oob     [oobSize]byte
	ooblen  int
}

// send sends one answer with sendmsg(2) (for answers that come later).
func (r *udpReply) send(b []byte) {
	if r.sock == nil || len(b) == 0 {
		return
	}
	r.sock.mu.RLock()
	defer r.sock.mu.RUnlock()
	if r.sock.closed {
		return
	}
	var h unix.Msghdr
	iov := unix.Iovec{Base: &b[0]}
	iov.SetLen(len(b))
	h.Name = (*byte)(unsafe.Pointer(&r.name))
	h.Namelen = r.namelen
	h.Iov = &iov
	h.Iovlen = 1
	if r.ooblen > 0 {
		h.Control = &r.oob[0]
		h.SetControllen(r.ooblen)
	}
	_, _, _ = unix.Syscall(unix.SYS_SENDMSG, uintptr(r.sock.fd), uintptr(unsafe.Pointer(&h)), 0)
	runtime.KeepAlive(b)
	runtime.KeepAlive(r)
}

// udpReader is one reader thread's buffers: a batch of receive and send messages.
type udpReader struct {
	in      [udpBatch]mmsghdr
	inIov   [udpBatch]unix.Iovec
	names   [udpBatch]unix.RawSockaddrInet6
	oobs    [udpBatch][oobSize]byte
	bufs    [udpBatch][udpRxSize]byte
	out     [udpBatch]mmsghdr
	outIov  [udpBatch]unix.Iovec
	outBufs [udpBatch][maxUDPResponse]byte
	clients [udpBatch]client
}

// readUDP is one socket's reader (see the top of this file).
func (s *Server) readUDP(u *udpSock) {
	defer s.readers.Done()
	if s.readerNice != 0 {
		s.prioritizeReader()
	}
	r := new(udpReader)
	w := newWorker(s)
	for i := range udpBatch {
		r.inIov[i].Base = &r.bufs[i][0]
		r.inIov[i].SetLen(udpRxSize)
		h := &r.in[i].hdr
		h.Name = (*byte)(unsafe.Pointer(&r.names[i]))
		h.Iov = &r.inIov[i]
		h.Iovlen = 1
		r.out[i].hdr.Iov = &r.outIov[i]
		r.out[i].hdr.Iovlen = 1
	}
	for !s.stopping.Load() {
		for i := range udpBatch {
			h := &r.in[i].hdr
			h.Namelen = unix.SizeofSockaddrInet6
			h.Flags = 0
			if u.pktinfo {
				h.Control = &r.oobs[i][0]
				h.SetControllen(oobSize)
			}
		}
		// A raw system call: the goroutine keeps its P as if it were running, so the
		// scheduler never hands the P over, and the runtime's monitor thread (sysmon)
		// has no idle P to wake up for on every packet. The receive timeout bounds the
		// block; any signal (the runtime's preemption, a stop-the-world) interrupts it
		// with EINTR, and safePoint then gives the runtime its safe point.
		n, _, errno := unix.RawSyscall6(unix.SYS_RECVMMSG, uintptr(u.fd), uintptr(unsafe.Pointer(&r.in[0])), udpBatch, unix.MSG_WAITFORONE, 0, 0)
		if errno != 0 {
			safePoint()
			switch errno {
			case unix.EAGAIN, unix.EINTR:
				continue // receive timeout or a signal: look at the stop flag
			case unix.EBADF:
				return
			}
			s.log.Debug("udp receive", "err", errno)
			continue
		}
		s.dequeued(int(n))
		start := time.Now()
		k := 0
		for i := range int(n) {
			if r.in[i].n == 0 {
				continue // a liveness probe (handover.go): counted, not answered
			}
			h := &r.in[i].hdr
			c := &r.clients[i]
			*c = client{proto: protoUDP}
			c.setSender(s, rawAddrPort(&r.names[i]))
			c.reply.sock = u
			c.reply.name = r.names[i]
			c.reply.namelen = h.Namelen
			c.reply.ooblen = 0
			if u.pktinfo {
				c.reply.ooblen = len(replyPktinfo(r.oobs[i][:h.Controllen], c.reply.oob[:0]))
			}
			resp := w.serve(r.bufs[i][:r.in[i].n], r.outBufs[k][:], c, start)
			if resp == nil {
				continue
			}
			o := &r.out[k].hdr
			r.outIov[k].Base = &resp[0]
			r.outIov[k].SetLen(len(resp))
			o.Name = (*byte)(unsafe.Pointer(&c.reply.name))
			o.Namelen = c.reply.namelen
			o.Control, o.Controllen = nil, 0
			if c.reply.ooblen > 0 {
				o.Control = &c.reply.oob[0]
				o.SetControllen(c.reply.ooblen)
			}
			k++
		}
		for sent := 0; sent < k; {
			m, _, errno := unix.RawSyscall6(unix.SYS_SENDMMSG, uintptr(u.fd), uintptr(unsafe.Pointer(&r.out[sent])), uintptr(k-sent), 0, 0, 0)
			if errno != 0 {
				if errno == unix.EINTR {
					continue
				}
				s.log.Debug("udp send", "err", errno)
				sent++ // skip the message the kernel refused
				continue
			}
			sent += int(m)
		}
	}
}

// prioritizeReader locks the calling reader to its thread and gives the thread
// Config.ReaderNice. The lock is never undone: the thread ends with the reader and
// never runs anything else (the main thread, which the runtime never ends, stays
// parked). Without the privilege the reader is left as it was.
func (s *Server) prioritizeReader() {
	runtime.LockOSThread()
	if err := unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), s.readerNice); err != nil {
		runtime.UnlockOSThread()
		s.niceFailed.Do(func() {
			s.log.Warn("UDP readers keep the process's priority", "nice", s.readerNice, "err", err)
		})
	}
}

// safePoint yields to the runtime after an interrupted or timed-out receive.
// It is a call, not runtime.Gosched alone: Gosched (like the raw system call
// and the loop around it) is nosplit and never checks for a pending preemption,
// so a collection waiting to scan this goroutine's stack (which stops one
// goroutine at a time and signals it) never caught an idle reader that went
// straight back into the kernel: collections took seconds with idle readers,
// and everything that allocates waited for them. This function's prologue
// checks, and parks the goroutine for the scan. It must not be inlined.
//
//go:noinline
func safePoint() { runtime.Gosched() }

// rawAddrPort returns the unmapped address and the port of a received sockaddr.
func rawAddrPort(sa *unix.RawSockaddrInet6) netip.AddrPort {
	port := binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&sa.Port))[:]) // network byte order in both families
	switch sa.Family {
	case unix.AF_INET:
		a := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), port)
	case unix.AF_INET6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr).Unmap(), port)
	}
	return netip.AddrPort{}
}

// replyPktinfo turns the received packet-info control message into one
// that makes the kernel send the reply from the query's destination
// address. It returns nil when there is none.
func replyPktinfo(oob, out []byte) []byte {
	for len(oob) >= unix.SizeofCmsghdr {
		h, data, rest, err := unix.ParseOneSocketControlMessage(oob)
		if err != nil {
			return nil
		}
		oob = rest
		switch {
		case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_PKTINFO && len(data) >= unix.SizeofInet4Pktinfo:
			in := (*unix.Inet4Pktinfo)(unsafe.Pointer(&data[0]))
			return appendCmsg(out, unix.IPPROTO_IP, unix.IP_PKTINFO, unix.SizeofInet4Pktinfo, func(b []byte) {
				p := (*unix.Inet4Pktinfo)(unsafe.Pointer(&b[0]))
				p.Spec_dst = in.Addr
			})
		case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_PKTINFO && len(data) >= unix.SizeofInet6Pktinfo:
			in := (*unix.Inet6Pktinfo)(unsafe.Pointer(&data[0]))
			return appendCmsg(out, unix.IPPROTO_IPV6, unix.IPV6_PKTINFO, unix.SizeofInet6Pktinfo, func(b []byte) {
				p := (*unix.Inet6Pktinfo)(unsafe.Pointer(&b[0]))
				p.Addr = in.Addr
				p.Ifindex = in.Ifindex
			})
		}
	}
	return nil
}

func appendCmsg(out []byte, level, typ int32, datalen int, fill func([]byte)) []byte {
	space := unix.CmsgSpace(datalen)
	if cap(out) < space {
		out = make([]byte, 0, space)
	}
	b := out[:space]
	clear(b)
	h := (*unix.Cmsghdr)(unsafe.Pointer(&b[0]))
	h.Level, h.Type = level, typ
	h.SetLen(unix.CmsgLen(datalen))
	fill(b[unix.CmsgLen(0):])
	return b
}
