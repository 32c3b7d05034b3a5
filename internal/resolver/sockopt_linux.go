//go:build linux

package resolver

import (
	"net"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// reusePortSupported: one UDP socket per CPU shares the address through
// SO_REUSEPORT and the kernel spreads packets over them.
const reusePortSupported = true

// udpRcvBuf is the receive buffer asked for on each UDP socket.
const udpRcvBuf = 4 << 20

func listenConfig() net.ListenConfig {
	lc := net.ListenConfig{Control: func(network, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
			if strings.HasPrefix(network, "udp") {
				// Absorb bursts; best effort (capped by net.core.rmem_max).
				_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, udpRcvBuf)
			}
		})
		if err != nil {
			return err
		}
		return serr
	}}
	// Plain TCP, not Go's default MPTCP: the datapath registers the listener in a
	// SOCKMAP, which takes TCP sockets only.
	lc.SetMultipathTCP(false)
	return lc
}

// setPktinfo asks for the destination address of each packet when the
// socket is bound to a wildcard address, so replies leave from the address
// the query was sent to. It reports whether packet info is on.
func setPktinfo(c *net.UDPConn) bool {
	la, ok := c.LocalAddr().(*net.UDPAddr)
	if !ok || !la.IP.IsUnspecified() {
		return false
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	var serr error
	_ = rc.Control(func(fd uintptr) {
		if la.IP.To4() != nil {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
		} else {
			// Also reports IPv4 packets of a dual-stack socket (mapped).
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1)
		}
	})
	return serr == nil
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
