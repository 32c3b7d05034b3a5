//go:build !linux

package upstream

import (
	"errors"
	"fmt"
	"net"
	"time"
)

// Outside Linux each upstream UDP socket is a net.Conn with a goroutine of its own
// that reads it; the resolver's readers cannot claim the replies.

// udpConn is one connected UDP socket to an upstream.
type udpConn struct{ conn net.Conn }

func (c *udpConn) write(b []byte) error {
	_, err := c.conn.Write(b)
	return err
}

func (c *udpConn) close() { c.conn.Close() }

// replySet starts a reader per socket.
type replySet struct{ f *Forwarder }

func newReplySet(f *Forwarder) (*replySet, error) { return &replySet{f: f}, nil }

func (rs *replySet) start()               {}
func (rs *replySet) close()               {}
func (rs *replySet) closeFDs()            {}
func (rs *replySet) claim() (int, bool)   { return -1, false }
func (rs *replySet) release()             {}
func (rs *replySet) readReplies(int) bool { return false }

// open dials c's socket for p and starts its reader. Under p.mu, with p open.
func (rs *replySet) open(p *socketPool, c *udpSocket) (*udpConn, error) {
	if rs == nil {
		return nil, errors.New("upstream forwarder not started")
	}
	conn, err := p.f.dialer.Dial("udp", p.s.addrStr)
	if err != nil {
		return nil, failed(netReason(err), fmt.Errorf("dial udp %s: %w", p.s.addrStr, err))
	}
	p.f.wg.Add(1) // p is open: Close has not begun waiting
	go func() {
		defer p.f.wg.Done()
		readConn(p, c, conn)
	}()
	return &udpConn{conn: conn}, nil
}

// readConn hands every datagram on conn to received until it is closed.
func readConn(p *socketPool, c *udpSocket, conn net.Conn) {
	bp := udpBufPool.Get().(*[]byte)
	defer udpBufPool.Put(bp)
	buf := *bp
	for {
		n, err := conn.Read(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || p.readFailed(c, err) {
				return
			}
			continue
		}
		p.received(c, buf[:n], n == len(buf), time.Now())
	}
}
