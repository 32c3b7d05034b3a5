package upstream

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

// The UDP sockets to one upstream. An attempt does not open a socket of its own: each
// upstream has one current socket, connected to it and marked, that new attempts are
// sent on with a query ID no other attempt waiting on that socket has, and one
// goroutine reading the socket hands every reply to the attempt its ID names (after
// checking that it answers that attempt's question). An attempt therefore costs a
// send and, when its reply comes, a receive: no socket, goroutine or channel of its own.
//
// The source port stays unpredictable: a socket takes at most socketUses queries and
// none once it is socketAge old; then a new socket (a new random port) takes over, and
// the retired one is closed as soon as no attempt waits on it any longer. An off-path
// attacker who finds an open port (SAD DNS) has at most that many queries and that
// long to guess an ID, and every guess must also come from the upstream's address
// (the socket is connected) with the query's question.

const (
	// socketUses is the number of queries one upstream socket takes before a new one
	// takes over.
	socketUses = 32
	// socketAge is how long one upstream socket takes new queries.
	socketAge = time.Second
)

// errSocketsClosed is what an attempt gets once the forwarder is closing.
var errSocketsClosed = errors.New("upstream sockets closed")

// socketPool is one upstream's UDP sockets: the current one and the retired ones that
// attempts still wait on.
type socketPool struct {
	f *Forwarder
	s *server

	mu     sync.Mutex // guards everything below and every socket's fields
	cur    *udpSocket
	open   map[*udpSocket]struct{}
	closed bool
}

// udpSocket is one connected UDP socket to the upstream and the attempts waiting on it.
type udpSocket struct {
	conn    net.Conn
	opened  time.Time
	uses    int
	retired bool
	waiting map[uint16]*udpAttempt
}

// udpAttempt is one resolution's query to one upstream: the ID it has on its socket,
// the packed query (every retry to that upstream sends the same bytes, so a late reply
// to the first send still answers it), and what the resolution knows of its sends.
// Its sends and state are the resolution's (under its mutex); sock, id and msg do not
// change after register.
type udpAttempt struct {
	r         *resolution
	s         *server
	sock      *udpSocket
	id        uint16
	msg       dns.Msg // the query with id, for checking a reply
	wire      []byte
	sends     int
	firstSend time.Time
	dead      bool // answered with a failure or failed: no more sends
	released  bool // no longer on its socket
}

func newSocketPool(f *Forwarder, s *server) *socketPool {
	return &socketPool{f: f, s: s, open: make(map[*udpSocket]struct{})}
}

// register puts a new attempt of r for q on the current socket (opening one when there
// is none or it is used up), with an ID on it other than avoid.
func (p *socketPool) register(r *resolution, q *dns.Msg, avoid uint16) (*udpAttempt, error) {
	a := &udpAttempt{r: r, s: p.s, msg: *q} // the question and OPT are shared, read only
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errSocketsClosed
	}
	if c := p.cur; c == nil || c.uses >= socketUses || time.Since(c.opened) >= socketAge {
		if c != nil {
			p.retire(c)
		}
		if err := p.dial(); err != nil {
			return nil, err
		}
	}
	c := p.cur
	id := randomID(avoid)
	for c.waiting[id] != nil {
		id = randomID(avoid)
	}
	a.msg.Id = id
	wire, err := a.msg.Pack()
	if err != nil {
		return nil, fmt.Errorf("pack upstream query: %w", err)
	}
	a.sock, a.id, a.wire = c, id, wire
	c.waiting[id] = a
	c.uses++
	return a, nil
}

// dial opens the pool's new current socket, connected to the upstream and marked,
// and starts its reader. Under p.mu, with p open.
func (p *socketPool) dial() error {
	conn, err := p.f.dialer.Dial("udp", p.s.addrStr)
	if err != nil {
		return failed(netReason(err), fmt.Errorf("dial udp %s: %w", p.s.addrStr, err))
	}
	c := &udpSocket{conn: conn, opened: time.Now(), waiting: make(map[uint16]*udpAttempt)}
	p.cur = c
	p.open[c] = struct{}{}
	p.f.wg.Add(1) // p is open: Close has not begun waiting
	go func() {
		defer p.f.wg.Done()
		p.read(c)
	}()
	return nil
}

// retire takes c out of use for new attempts and closes it once none waits on it.
// Under p.mu.
func (p *socketPool) retire(c *udpSocket) {
	c.retired = true
	if p.cur == c {
		p.cur = nil
	}
	if len(c.waiting) == 0 {
		p.closeSocket(c)
	}
}

// closeSocket closes c, which ends its reader. Under p.mu.
func (p *socketPool) closeSocket(c *udpSocket) {
	if _, ok := p.open[c]; ok {
		delete(p.open, c)
		c.conn.Close()
	}
}

// release takes a off its socket: a reply to it is dropped from now on.
func (p *socketPool) release(a *udpAttempt) {
	if a.released {
		return
	}
	a.released = true
	p.mu.Lock()
	defer p.mu.Unlock()
	c := a.sock
	if c.waiting[a.id] == a {
		delete(c.waiting, a.id)
	}
	if c.retired && len(c.waiting) == 0 {
		p.closeSocket(c)
	}
}

// close closes every socket; no attempt can be registered after it.
func (p *socketPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	p.cur = nil
	for c := range p.open {
		p.closeSocket(c)
	}
}

// send sends a's query (again).
func (a *udpAttempt) send() error {
	if a.sends == 0 {
		a.firstSend = time.Now()
	}
	a.sends++
	a.s.m.reqUDP.Inc()
	if _, err := a.sock.conn.Write(a.wire); err != nil {
		return failed(netReason(err), fmt.Errorf("send to %s: %w", a.s.addrStr, err))
	}
	return nil
}

// received hands the datagram b, read from c at at, to the attempt it answers.
// Replies that match no waiting attempt's ID and question are dropped and counted:
// a spoofed or stale datagram cannot end a resolution. b is the reader's buffer,
// udpReadSize and one byte more: a datagram that fills it was cut.
func (p *socketPool) received(c *udpSocket, b []byte, full bool, at time.Time) {
	if full && len(b) >= 12 {
		// Larger than udpReadSize: cut by the read. Taken as truncated (TC), so the
		// resolution retries over TCP; parseReply keeps the header and question.
		b[2] |= 0x02
	}
	a, resp, err := p.match(c, b)
	if err != nil {
		p.s.m.failures[reasonMismatch].Inc()
		p.f.log.Debug("dropped upstream reply", "upstream", p.s.name, "err", err)
		return
	}
	p.s.lastReply.Store(monoNow()) // when it came, not when the resolution reads it
	a.r.replied(a, resp, at)
}

// readFailed takes a socket error on c: it fails every attempt waiting on c. It
// reports whether the socket is done with: any error but the upstream's port
// unreachable (after which the socket still works).
func (p *socketPool) readFailed(c *udpSocket, err error) bool {
	p.failAll(c, failed(netReason(err), fmt.Errorf("read from %s: %w", p.s.addrStr, err)))
	return !errors.Is(err, syscall.ECONNREFUSED)
}

// match finds the attempt waiting on c that b answers.
func (p *socketPool) match(c *udpSocket, b []byte) (*udpAttempt, *dns.Msg, error) {
	if len(b) < 12 {
		return nil, nil, fmt.Errorf("short reply (%d bytes)", len(b))
	}
	id := binary.BigEndian.Uint16(b)
	p.mu.Lock()
	a := c.waiting[id]
	p.mu.Unlock()
	if a == nil {
		return nil, nil, fmt.Errorf("reply id %d matches no query waiting", id)
	}
	resp, err := parseReply(b, &a.msg)
	return a, resp, err
}

// failAll fails every attempt waiting on c with err and retires c: an ICMP error
// queued on a connected socket names no datagram, and every query on it went to the
// same port.
func (p *socketPool) failAll(c *udpSocket, err error) {
	p.mu.Lock()
	as := make([]*udpAttempt, 0, len(c.waiting))
	for _, a := range c.waiting {
		as = append(as, a)
	}
	p.retire(c)
	p.mu.Unlock()
	for _, a := range as {
		a.r.failedAttempt(a, err)
	}
}

// read hands every datagram on c to received until c is closed.
func (p *socketPool) read(c *udpSocket) {
	bp := udpBufPool.Get().(*[]byte)
	defer udpBufPool.Put(bp)
	buf := *bp
	for {
		n, err := c.conn.Read(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || p.readFailed(c, err) {
				return
			}
			continue
		}
		p.received(c, buf[:n], n == len(buf), time.Now())
	}
}
