package redirect

// The DNS client the privileged tests start inside the test cgroup (as a given
// UID, in the test's network namespace): the test binary re-executed with
// MESHDNS_REDIRECT_CLIENT=1. It talks to the kernel with raw socket calls so each
// mode exercises exactly one path through the hooks, and prints one JSON line per
// query with the reply source / peer the kernel reported.

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

const clientEnv = "MESHDNS_REDIRECT_CLIENT"

// clientResult is one query's outcome.
type clientResult struct {
	Dst    string   `json:"dst"`            // where the client sent it
	Src    string   `json:"src,omitempty"`  // reply source reported by recvfrom
	Peer   string   `json:"peer,omitempty"` // getpeername after connect
	Rcode  string   `json:"rcode,omitempty"`
	A      []string `json:"a,omitempty"`
	Err    string   `json:"err,omitempty"`
	TMono  uint64   `json:"t_mono,omitempty"` // CLOCK_MONOTONIC just before connect (loop mode)
	TConn  uint64   `json:"t_conn,omitempty"` // CLOCK_MONOTONIC just after connect returned
	Socket int      `json:"socket"`           // index of the socket used
}

// runClient is the client's main; it returns the exit code.
func runClient(args []string) int {
	fs := flag.NewFlagSet("client", flag.ContinueOnError)
	mode := fs.String("mode", "connect", "connect|sendto|tcp|godial|loop|many")
	family := fs.Int("family", 4, "socket family: 4 or 6 (v4 destinations become ::ffff:a.b.c.d)")
	dsts := fs.String("dst", "", "comma-separated ip:port destinations")
	name := fs.String("name", "mesh.test", "name to query (type A)")
	n := fs.Int("n", 1, "queries, each on a new socket (sendto: one socket for all destinations)")
	mark := fs.Uint("mark", 0, "SO_MARK for the sockets")
	hold := fs.Bool("hold", false, "print HOLD and keep the sockets open until stdin closes")
	again := fs.Bool("again", false, "with -hold: on each stdin line, query again on every connected UDP socket, then print HOLD")
	dur := fs.Duration("dur", 0, "loop mode: how long to keep querying")
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for each reply")
	noSend := fs.Bool("nosend", false, "connect mode: connect, then close without sending")
	srcs := fs.String("src", "", "many mode: comma-separated source addresses the sockets bind to in turn")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	var targets []netip.AddrPort
	for _, s := range strings.Split(*dsts, ",") {
		ap, err := netip.ParseAddrPort(strings.TrimSpace(s))
		if err != nil {
			fmt.Fprintf(os.Stderr, "bad -dst %q: %v\n", s, err)
			return 2
		}
		targets = append(targets, ap)
	}
	c := &client{family: *family, name: *name, mark: int(*mark), timeout: *timeout, noSend: *noSend, out: json.NewEncoder(os.Stdout)}
	switch *mode {
	case "connect", "tcp", "godial":
		for i := 0; i < *n; i++ {
			for _, dst := range targets {
				c.emit(c.one(*mode, dst, len(c.fds)))
			}
		}
	case "sendto":
		for i := 0; i < *n; i++ {
			for _, r := range c.sendto(targets, len(c.fds)) {
				c.emit(r)
			}
		}
	case "many":
		var from []netip.Addr
		for _, a := range strings.Split(*srcs, ",") {
			if a != "" {
				from = append(from, netip.MustParseAddr(a))
			}
		}
		return c.many(targets[0], *n, from)
	case "loop":
		end := time.Now().Add(*dur)
		for time.Now().Before(end) {
			c.emit(c.one("connect", targets[0], len(c.fds)))
			c.closeAll()
			time.Sleep(5 * time.Millisecond)
		}
	default:
		fmt.Fprintf(os.Stderr, "unknown mode %q\n", *mode)
		return 2
	}
	if *hold {
		fmt.Println("HOLD")
		if *again {
			sc := bufio.NewScanner(os.Stdin)
			for sc.Scan() {
				for i, conn := range c.conns {
					c.emit(c.requery(conn, i))
				}
				fmt.Println("HOLD")
			}
		}
		_, _ = io.Copy(io.Discard, bufio.NewReader(os.Stdin))
	}
	c.closeAll()
	return 0
}

type client struct {
	family  int
	name    string
	mark    int
	timeout time.Duration
	noSend  bool
	out     *json.Encoder
	fds     []int
	conns   []connected // connected UDP sockets, for -again
}

type connected struct {
	fd  int
	dst netip.AddrPort
}

// requery sends a new query on an already connected UDP socket.
func (c *client) requery(conn connected, sock int) clientResult {
	r := clientResult{Dst: conn.dst.String(), Socket: sock}
	q, qb := c.query()
	sendAndRead(&r, conn.fd, q, qb)
	return r
}

// sendAndRead sends query qb on the connected UDP socket fd and reads the
// reply into r.
func sendAndRead(r *clientResult, fd int, q *dns.Msg, qb []byte) {
	if err := noEINTR(func() error { return unix.Send(fd, qb, 0) }); err != nil {
		r.Err = "send: " + err.Error()
		return
	}
	buf := make([]byte, 4096)
	n, from, err := recvfrom(fd, buf)
	if err != nil {
		r.Err = "recvfrom: " + err.Error()
		return
	}
	r.Src = sockaddrString(from)
	parseReply(r, q, buf[:n])
}

func (c *client) emit(r clientResult) { _ = c.out.Encode(r) }

func (c *client) closeAll() {
	for _, fd := range c.fds {
		unix.Close(fd)
	}
	c.fds = nil
	c.conns = nil
}

func (c *client) socket(typ int) (int, error) {
	af := unix.AF_INET
	if c.family == 6 {
		af = unix.AF_INET6
	}
	fd, err := unix.Socket(af, typ|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	c.fds = append(c.fds, fd)
	if af == unix.AF_INET6 {
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0); err != nil {
			return -1, fmt.Errorf("IPV6_V6ONLY=0: %w", err)
		}
	}
	if c.mark != 0 {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, c.mark); err != nil {
			return -1, fmt.Errorf("SO_MARK: %w", err)
		}
	}
	tv := unix.NsecToTimeval(c.timeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return -1, fmt.Errorf("SO_RCVTIMEO: %w", err)
	}
	return fd, nil
}

func (c *client) sockaddr(ap netip.AddrPort) unix.Sockaddr {
	if c.family == 4 {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().Unmap().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

func sockaddrString(sa unix.Sockaddr) string {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)).String()
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port)).String()
	}
	return fmt.Sprintf("%v", sa)
}

func (c *client) query() (*dns.Msg, []byte) {
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(c.name), dns.TypeA)
	b, _ := m.Pack()
	return m, b
}

func parseReply(r *clientResult, q *dns.Msg, b []byte) {
	m := new(dns.Msg)
	if err := m.Unpack(b); err != nil {
		r.Err = "unpack reply: " + err.Error()
		return
	}
	if m.Id != q.Id {
		r.Err = fmt.Sprintf("reply id %d != query id %d", m.Id, q.Id)
		return
	}
	r.Rcode = dns.RcodeToString[m.Rcode]
	for _, rr := range m.Answer {
		if a, ok := rr.(*dns.A); ok {
			r.A = append(r.A, a.A.String())
		}
	}
}

func (c *client) one(mode string, dst netip.AddrPort, sock int) clientResult {
	r := clientResult{Dst: dst.String(), Socket: sock}
	q, qb := c.query()
	switch mode {
	case "godial":
		conn, err := net.DialTimeout("udp", dst.String(), 2*time.Second)
		if err != nil {
			r.Err = err.Error()
			return r
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := conn.Write(qb); err != nil {
			r.Err = err.Error()
			return r
		}
		buf := make([]byte, 4096)
		n, err := conn.Read(buf)
		if err != nil {
			r.Err = err.Error()
			return r
		}
		parseReply(&r, q, buf[:n])
		return r
	case "connect":
		fd, err := c.socket(unix.SOCK_DGRAM)
		if err != nil {
			r.Err = err.Error()
			return r
		}
		r.TMono = monotonicNow()
		if err := unix.Connect(fd, c.sockaddr(dst)); err != nil {
			r.Err = "connect: " + err.Error()
			return r
		}
		r.TConn = monotonicNow()
		c.conns = append(c.conns, connected{fd: fd, dst: dst})
		if sa, err := unix.Getpeername(fd); err == nil {
			r.Peer = sockaddrString(sa)
		}
		if c.noSend {
			return r
		}
		sendAndRead(&r, fd, q, qb)
		return r
	case "tcp":
		fd, err := c.socket(unix.SOCK_STREAM)
		if err != nil {
			r.Err = err.Error()
			return r
		}
		if err := unix.Connect(fd, c.sockaddr(dst)); err != nil {
			r.Err = "connect: " + err.Error()
			return r
		}
		if sa, err := unix.Getpeername(fd); err == nil {
			r.Peer = sockaddrString(sa)
		}
		msg := binary.BigEndian.AppendUint16(nil, uint16(len(qb)))
		if err := noEINTR(func() error { _, err := unix.Write(fd, append(msg, qb...)); return err }); err != nil {
			r.Err = "write: " + err.Error()
			return r
		}
		var l [2]byte
		if err := readFull(fd, l[:]); err != nil {
			r.Err = "read: " + err.Error()
			return r
		}
		buf := make([]byte, binary.BigEndian.Uint16(l[:]))
		if err := readFull(fd, buf); err != nil {
			r.Err = "read: " + err.Error()
			return r
		}
		parseReply(&r, q, buf)
		return r
	}
	r.Err = "bad mode " + mode
	return r
}

// sendto sends one query to each destination from one unconnected socket (like
// musl), then reads len(dsts) replies and matches them to queries by id.
func (c *client) sendto(dsts []netip.AddrPort, sock int) []clientResult {
	fd, err := c.socket(unix.SOCK_DGRAM)
	if err != nil {
		return []clientResult{{Err: err.Error(), Socket: sock}}
	}
	type sent struct {
		q   *dns.Msg
		res clientResult
	}
	byID := map[uint16]*sent{}
	var order []*sent
	for _, dst := range dsts {
		q, qb := c.query()
		for byID[q.Id] != nil {
			q, qb = c.query()
		}
		s := &sent{q: q, res: clientResult{Dst: dst.String(), Socket: sock}}
		byID[q.Id] = s
		order = append(order, s)
		if err := noEINTR(func() error { return unix.Sendto(fd, qb, 0, c.sockaddr(dst)) }); err != nil {
			s.res.Err = "sendto: " + err.Error()
			delete(byID, q.Id)
		}
	}
	buf := make([]byte, 4096)
	for len(byID) > 0 {
		n, from, err := recvfrom(fd, buf)
		if err != nil {
			for _, s := range byID {
				s.res.Err = "recvfrom: " + err.Error()
			}
			break
		}
		if n < 2 {
			continue
		}
		s := byID[binary.BigEndian.Uint16(buf[:2])]
		if s == nil {
			continue
		}
		delete(byID, s.q.Id)
		s.res.Src = sockaddrString(from)
		parseReply(&s.res, s.q, buf[:n])
	}
	out := make([]clientResult, 0, len(order))
	for _, s := range order {
		out = append(out, s.res)
	}
	return out
}

func readFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.Read(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrUnexpectedEOF
		}
		b = b[n:]
	}
	return nil
}

// noEINTR retries a system call the Go runtime's signals interrupted.
func noEINTR(f func() error) error {
	for {
		if err := f(); err != unix.EINTR {
			return err
		}
	}
}

func recvfrom(fd int, buf []byte) (int, unix.Sockaddr, error) {
	for {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != unix.EINTR {
			return n, from, err
		}
	}
}

// manyResult is what mode "many" prints.
type manyResult struct {
	Sockets  int `json:"sockets"`  // sockets open at once
	Answered int `json:"answered"` // replies from the address the query was sent to
	WrongSrc int `json:"wrong_src"`
	Lost     int `json:"lost"`
}

// many opens n UDP sockets (bound to srcs in turn, if given) and connects each
// to dst, as glibc does before it sends (the connect is what the programs
// redirect and record); then it prints OPEN and waits for a line on stdin (every
// client of the test has connected its sockets), and only then does each
// socket send its query and read the reply, in batches. A reply whose source
// is not dst means the socket's state was lost in between.
func (c *client) many(dst netip.AddrPort, n int, srcs []netip.Addr) int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err == nil && lim.Cur < uint64(n)+64 {
		lim.Cur = uint64(n) + 64
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
			fmt.Fprintf(os.Stderr, "raise RLIMIT_NOFILE: %v\n", err)
			return 1
		}
	}
	res := manyResult{}
	fds := make([]int, 0, n)
	defer func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}()
	af := unix.AF_INET
	if c.family == 6 {
		af = unix.AF_INET6
	}
	for len(fds) < n {
		fd, err := unix.Socket(af, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			fmt.Fprintf(os.Stderr, "socket %d: %v\n", len(fds), err)
			return 1
		}
		fds = append(fds, fd)
		// One source address has ~28k ephemeral ports: bind to several.
		if len(srcs) > 0 {
			if err := unix.Bind(fd, c.sockaddr(netip.AddrPortFrom(srcs[len(fds)%len(srcs)], 0))); err != nil {
				fmt.Fprintf(os.Stderr, "bind socket %d: %v\n", len(fds), err)
				return 1
			}
		}
		if err := unix.Connect(fd, c.sockaddr(dst)); err != nil {
			fmt.Fprintf(os.Stderr, "connect socket %d: %v\n", len(fds), err)
			return 1
		}
	}
	res.Sockets = len(fds)
	fmt.Println("OPEN")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n')

	const batch = 64
	want := sockaddrString(c.sockaddr(dst))
	buf := make([]byte, 4096)
	for i := 0; i < len(fds); i += batch {
		pending := map[int]uint16{}
		for _, fd := range fds[i:min(i+batch, len(fds))] {
			q, qb := c.query()
			if err := noEINTR(func() error { return unix.Send(fd, qb, 0) }); err != nil {
				res.Lost++
				continue
			}
			pending[fd] = q.Id
		}
		deadline := time.Now().Add(c.timeout)
		for len(pending) > 0 && time.Now().Before(deadline) {
			pfds := make([]unix.PollFd, 0, len(pending))
			for fd := range pending {
				pfds = append(pfds, unix.PollFd{Fd: int32(fd), Events: unix.POLLIN})
			}
			if _, err := unix.Poll(pfds, int(time.Until(deadline).Milliseconds())+1); err != nil && err != unix.EINTR {
				break
			}
			for _, p := range pfds {
				if p.Revents == 0 {
					continue
				}
				fd := int(p.Fd)
				nr, from, err := unix.Recvfrom(fd, buf, 0)
				if err != nil || nr < 2 || binary.BigEndian.Uint16(buf) != pending[fd] {
					continue
				}
				delete(pending, fd)
				if sockaddrString(from) == want {
					res.Answered++
				} else {
					res.WrongSrc++
				}
			}
		}
		res.Lost += len(pending)
	}
	_ = c.out.Encode(res)
	return 0
}
