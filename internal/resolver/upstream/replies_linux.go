//go:build linux

package upstream

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// On Linux the upstream UDP sockets stay out of Go's network poller. The poller
// watches every socket for writing too, so each query sent woke the thread waiting in
// it (the send buffer's space coming back is an event), and a reply woke it again; on
// a resolver reader's CPU those threads preempted the reader about once a resolution
// (bench/RESULTS.md, section 17). Here the sockets are non-blocking, a query is sent
// with a plain system call from the goroutine that sends it (the resolver's reader for
// a miss: it keeps its scheduler slot), and they sit in one epoll set watched for
// reading only (a replySet). One resolver UDP reader may claim that set
// (Forwarder.ClaimReplies): it waits on it beside its own socket and reads the replies
// between its batches, so a resolution wakes no other thread. While none has claimed
// it, a goroutine of the forwarder waits on it.

// udpConn is one non-blocking, connected UDP socket in the forwarder's reply set.
type udpConn struct {
	rs  *replySet
	key int32 // its key in the epoll set

	mu     sync.RWMutex // a read or a write holds it shared, close alone: fd is not reused under them
	fd     int
	closed bool
}

// write sends b. It never blocks: a full send buffer is an error (EAGAIN).
func (c *udpConn) write(b []byte) error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return net.ErrClosed
	}
	// A raw system call: the sender keeps its scheduler slot (a resolver reader holds
	// its slot while it waits in the kernel; see resolver.Config.OnReaders).
	_, _, errno := unix.RawSyscall(unix.SYS_WRITE, uintptr(c.fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if errno != 0 {
		return os.NewSyscallError("write", errno)
	}
	return nil
}

// read reads one datagram into b without waiting: unix.EAGAIN when there is none.
func (c *udpConn) read(b []byte) (int, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed {
		return 0, net.ErrClosed
	}
	n, _, errno := unix.RawSyscall(unix.SYS_READ, uintptr(c.fd), uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)))
	if errno != 0 {
		return 0, errno
	}
	return int(n), nil
}

// close closes the socket, which takes it out of the epoll set.
func (c *udpConn) close() {
	c.mu.Lock()
	if !c.closed {
		c.closed = true
		unix.Close(c.fd)
	}
	c.mu.Unlock()
	c.rs.forget(c.key)
}

// mute takes the socket out of the epoll set (an error it keeps reporting after its
// attempts were failed) until it is closed.
func (c *udpConn) mute() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if !c.closed {
		_ = unix.EpollCtl(c.rs.epfd, unix.EPOLL_CTL_DEL, c.fd, nil)
	}
}

// replySet is the forwarder's upstream UDP sockets in one epoll set, and who reads
// them: the resolver reader that claimed the set, else its own goroutine.
type replySet struct {
	f      *Forwarder
	epfd   int
	wakefd int // an eventfd: wakes the set's own goroutine (a claim, Close)

	life   sync.RWMutex // ReadReplies holds it shared, close alone
	closed bool

	mu      sync.Mutex
	targets map[int32]replyTarget
	next    int32

	claimed   atomic.Bool
	unclaimed chan struct{} // a release, for the set's own goroutine
	done      chan struct{} // closed by close
}

// replyTarget is where a ready socket's datagrams go.
type replyTarget struct {
	p    *socketPool
	c    *udpSocket
	conn *udpConn
}

// fallbackBatch is how many replies the set's own goroutine reads per wake-up.
const fallbackBatch = 64

func newReplySet(f *Forwarder) (*replySet, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("upstream reply set: epoll: %w", err)
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("upstream reply set: eventfd: %w", err)
	}
	return &replySet{f: f, epfd: epfd, wakefd: wakefd, targets: make(map[int32]replyTarget),
		unclaimed: make(chan struct{}, 1), done: make(chan struct{})}, nil
}

// start runs the set's own goroutine until close.
func (rs *replySet) start() {
	rs.f.wg.Add(1)
	go func() {
		defer rs.f.wg.Done()
		rs.run()
	}()
}

// close makes ReadReplies and claim refuse and ends the set's own goroutine. The
// sockets are closed by their pools; the set's descriptors by closeFDs.
func (rs *replySet) close() {
	rs.life.Lock()
	if !rs.closed {
		rs.closed = true
		close(rs.done)
		rs.wake()
	}
	rs.life.Unlock()
}

// closeFDs closes the set's descriptors, once close was called and its goroutine
// has ended (nothing uses them then: ReadReplies and claim refuse after close).
func (rs *replySet) closeFDs() {
	unix.Close(rs.epfd)
	unix.Close(rs.wakefd)
}

func (rs *replySet) wake() {
	one := [8]byte{1}
	_, _ = unix.Write(rs.wakefd, one[:])
}

// run reads the replies while no resolver reader has claimed them.
func (rs *replySet) run() {
	bp := udpBufPool.Get().(*[]byte)
	defer udpBufPool.Put(bp)
	fds := []unix.PollFd{{Fd: int32(rs.epfd), Events: unix.POLLIN}, {Fd: int32(rs.wakefd), Events: unix.POLLIN}}
	var drain [8]byte
	for {
		if rs.claimed.Load() {
			select {
			case <-rs.unclaimed:
			case <-rs.done:
				return
			}
			continue
		}
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			rs.f.log.Error("upstream replies: poll failed; replies are no longer read", "err", err)
			return
		}
		if fds[1].Revents != 0 {
			_, _ = unix.Read(rs.wakefd, drain[:])
			select {
			case <-rs.done:
				return
			default:
			}
		}
		if fds[0].Revents != 0 && !rs.claimed.Load() {
			rs.readReady(*bp, fallbackBatch)
		}
	}
}

// claim gives the replies to the caller: the epoll descriptor to wait on.
func (rs *replySet) claim() (int, bool) {
	rs.life.RLock()
	defer rs.life.RUnlock()
	if rs.closed || !rs.claimed.CompareAndSwap(false, true) {
		return -1, false
	}
	rs.wake() // the set's own goroutine stops waiting on them
	return rs.epfd, true
}

// release takes the replies back from the reader that claimed them.
func (rs *replySet) release() {
	if rs.claimed.CompareAndSwap(true, false) {
		select {
		case rs.unclaimed <- struct{}{}:
		default:
		}
	}
}

// readReplies reads and hands on at most most waiting replies; false once closed.
func (rs *replySet) readReplies(most int) bool {
	rs.life.RLock()
	defer rs.life.RUnlock()
	if rs.closed {
		return false
	}
	bp := udpBufPool.Get().(*[]byte)
	rs.readReady(*bp, most)
	udpBufPool.Put(bp)
	return true
}

// readReady reads up to most datagrams from the sockets epoll reports ready.
func (rs *replySet) readReady(buf []byte, most int) {
	var events [16]unix.EpollEvent
	n, err := unix.EpollWait(rs.epfd, events[:min(most, len(events))], 0)
	if err != nil {
		return // EINTR; or the set is closing
	}
	for _, ev := range events[:n] {
		rs.mu.Lock()
		t, ok := rs.targets[ev.Fd]
		rs.mu.Unlock()
		if ok && most > 0 {
			most -= rs.drain(t, buf, most)
		}
	}
}

// drain reads at most most datagrams waiting on t's socket and hands them on. It
// returns how many it read.
func (rs *replySet) drain(t replyTarget, buf []byte, most int) int {
	k := 0
	for k < most {
		n, err := t.conn.read(buf)
		switch {
		case err == nil:
			k++
			t.p.received(t.c, buf[:n], n == len(buf), time.Now())
		case errors.Is(err, unix.EAGAIN), errors.Is(err, net.ErrClosed):
			return k
		case errors.Is(err, unix.EINTR):
		default:
			if t.p.readFailed(t.c, err) {
				t.conn.mute() // nothing an attempt could take comes on it any more
			}
			return k
		}
	}
	return k
}

// open opens c's socket for p: non-blocking, marked, connected to p's upstream, in
// the epoll set. Under p.mu.
func (rs *replySet) open(p *socketPool, c *udpSocket) (*udpConn, error) {
	if rs == nil {
		return nil, errors.New("upstream forwarder not started")
	}
	fd, err := dialUDP(p.s, p.f.cfg.Mark)
	if err != nil {
		return nil, err
	}
	rs.mu.Lock()
	rs.next++
	if rs.next < 0 {
		rs.next = 0 // the keys wrap; a socket lives far shorter than 2^31 others
	}
	conn := &udpConn{rs: rs, key: rs.next, fd: fd}
	rs.targets[conn.key] = replyTarget{p: p, c: c, conn: conn}
	rs.mu.Unlock()
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: conn.key}
	if err := unix.EpollCtl(rs.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		conn.close()
		return nil, fmt.Errorf("upstream reply set: add socket: %w", err)
	}
	return conn, nil
}

func (rs *replySet) forget(key int32) {
	rs.mu.Lock()
	delete(rs.targets, key)
	rs.mu.Unlock()
}

// dialUDP opens a non-blocking UDP socket with mark, connected to s (the kernel picks
// a random source port).
func dialUDP(s *server, mark uint32) (int, error) {
	addr := s.addr.Addr().Unmap()
	family := unix.AF_INET6
	var sa unix.Sockaddr
	if addr.Is4() {
		family = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(s.addr.Port()), Addr: addr.As4()}
	} else {
		sa6 := &unix.SockaddrInet6{Port: int(s.addr.Port()), Addr: addr.As16()}
		if z := addr.Zone(); z != "" {
			ifi, err := net.InterfaceByName(z)
			if err != nil {
				return -1, failed(reasonNetwork, fmt.Errorf("dial udp %s: zone: %w", s.addrStr, err))
			}
			sa6.ZoneId = uint32(ifi.Index)
		}
		sa = sa6
	}
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return -1, failed(netReason(err), fmt.Errorf("dial udp %s: socket: %w", s.addrStr, err))
	}
	if err := markFD(fd, mark, "udp", s.addrStr); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		return -1, failed(netReason(err), fmt.Errorf("dial udp %s: %w", s.addrStr, err))
	}
	return fd, nil
}
