package upstream

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/miekg/dns"
)

// ErrMark is returned (wrapped) when SO_MARK cannot be set on an upstream socket,
// typically EPERM without CAP_NET_ADMIN. Queries are never sent unmarked: an unmarked
// upstream query would be captured by our own datapath and loop back to us.
var ErrMark = errors.New("cannot set SO_MARK on upstream socket")

// checkMark creates (and closes) one unconnected UDP socket with the mark, so a missing
// privilege is reported by New instead of on the first query. Nothing is sent.
func checkMark(mark uint32) error {
	if mark == 0 {
		return nil
	}
	lc := net.ListenConfig{Control: control(mark)}
	pc, err := lc.ListenPacket(context.Background(), "udp", "127.0.0.1:0")
	if err != nil {
		if errors.Is(err, ErrMark) {
			return fmt.Errorf("upstream mark %#x (needs CAP_NET_ADMIN): %w", mark, err)
		}
		return fmt.Errorf("probe upstream mark %#x: %w", mark, err)
	}
	return pc.Close()
}

// bufPool holds receive buffers large enough for any DNS message (TCP).
var bufPool = sync.Pool{New: func() any { b := make([]byte, dns.MaxMsgSize); return &b }}

// udpReadSize is the largest UDP reply read whole. We advertise EDNSBufferSize (1232)
// and a server without EDNS sends at most 512 bytes; a reply larger than this (a
// server that ignores the advertised size) is taken as truncated and the query is
// retried over TCP. Each open upstream socket's reader holds one such buffer (when
// every waiting query had a reader of its own, 128 of them behind an upstream that
// drops held 8 MiB with buffers for the largest message).
const udpReadSize = 4096

// udpBufPool holds UDP receive buffers: udpReadSize and one byte more, so that a
// read that fills the buffer tells an oversized datagram.
var udpBufPool = sync.Pool{New: func() any { b := make([]byte, udpReadSize+1); return &b }}

// randomID returns a random query ID different from avoid.
func randomID(avoid uint16) uint16 {
	for {
		if id := uint16(rand.Uint32()); id != avoid {
			return id
		}
	}
}

// attemptError is a failed attempt with its metric reason.
type attemptError struct {
	reason string
	err    error
}

func (e *attemptError) Error() string { return e.err.Error() }
func (e *attemptError) Unwrap() error { return e.err }

func failed(reason string, err error) error { return &attemptError{reason: reason, err: err} }

// netReason classifies a socket error.
func netReason(err error) string {
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return reasonTimeout
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET):
		return reasonRefused
	default:
		return reasonNetwork
	}
}

// exchangeTCP sends q with ID id over a new connected TCP socket (after a truncated UDP
// answer) and returns the validated answer.
func (f *Forwarder) exchangeTCP(s *server, q *dns.Msg, id uint16, deadline time.Time) (*dns.Msg, error) {
	s.m.reqTCP.Inc()
	m := *q
	m.Id = id
	wire, err := m.Pack()
	if err != nil {
		return nil, fmt.Errorf("pack upstream query: %w", err)
	}
	d := f.dialer
	d.Deadline = deadline
	conn, err := d.Dial("tcp", s.addrStr)
	if err != nil {
		return nil, failed(reasonTruncated, fmt.Errorf("tcp retry after truncated udp answer: dial %s: %w", s.addrStr, err))
	}
	defer conn.Close()
	_ = conn.SetDeadline(deadline)
	out := make([]byte, 2+len(wire))
	binary.BigEndian.PutUint16(out, uint16(len(wire)))
	copy(out[2:], wire)
	if _, err := conn.Write(out); err != nil {
		return nil, failed(reasonTruncated, fmt.Errorf("tcp retry after truncated udp answer: send to %s: %w", s.addrStr, err))
	}
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	if _, err := io.ReadFull(conn, buf[:2]); err != nil {
		return nil, failed(reasonTruncated, fmt.Errorf("tcp retry after truncated udp answer: read length from %s: %w", s.addrStr, err))
	}
	n := int(binary.BigEndian.Uint16(buf[:2]))
	if _, err := io.ReadFull(conn, buf[:n]); err != nil {
		return nil, failed(reasonTruncated, fmt.Errorf("tcp retry after truncated udp answer: read from %s: %w", s.addrStr, err))
	}
	resp, err := parseReply(buf[:n], &m)
	if err != nil {
		s.m.failures[reasonMismatch].Inc()
		return nil, failed(reasonMismatch, fmt.Errorf("tcp answer from %s: %w", s.addrStr, err))
	}
	if resp.Truncated {
		return nil, failed(reasonTruncated, fmt.Errorf("truncated answer over tcp from %s", s.addrStr))
	}
	return resp, nil
}

// parseReply unpacks b and checks it answers q: same ID, QR set, same opcode and the
// same question (name compared case-insensitively). A truncated reply whose records
// do not unpack is returned with only its header and question.
func parseReply(b []byte, q *dns.Msg) (*dns.Msg, error) {
	if len(b) < 12 {
		return nil, fmt.Errorf("short reply (%d bytes)", len(b))
	}
	if id := binary.BigEndian.Uint16(b); id != q.Id {
		return nil, fmt.Errorf("reply id %d, want %d", id, q.Id)
	}
	resp := new(dns.Msg)
	if err := resp.Unpack(b); err != nil {
		// Some servers cut a UDP answer at 512 bytes mid-record but set TC; the TCP retry
		// gets the whole answer, so the header and question are enough here.
		if b[2]&0x02 == 0 {
			return nil, fmt.Errorf("unpack reply: %w", err)
		}
		hdr := new(dns.Msg)
		if err := hdr.Unpack(b[:12]); err != nil {
			return nil, fmt.Errorf("unpack truncated reply header: %w", err)
		}
		hdr.Question = q.Question
		return hdr, nil
	}
	if !resp.Response || resp.Opcode != q.Opcode {
		return nil, errors.New("reply is not a response to a query")
	}
	want := q.Question[0]
	switch {
	case len(resp.Question) == 1:
		got := resp.Question[0]
		if got.Qtype != want.Qtype || got.Qclass != want.Qclass || !equalFoldASCII(got.Name, lowerASCII(want.Name)) {
			return nil, fmt.Errorf("reply question %s %d %d does not match %s %d %d",
				got.Name, got.Qtype, got.Qclass, want.Name, want.Qtype, want.Qclass)
		}
	case len(resp.Question) == 0 && resp.Rcode != dns.RcodeSuccess && resp.Rcode != dns.RcodeNameError:
		// FORMERR/NOTIMP/REFUSED/SERVFAIL replies may omit the question; they never
		// become an answer.
	default:
		return nil, fmt.Errorf("reply has %d questions", len(resp.Question))
	}
	return resp, nil
}

func lowerASCII(s string) string {
	for i := 0; i < len(s); i++ {
		if 'A' <= s[i] && s[i] <= 'Z' {
			b := []byte(s)
			for j := i; j < len(b); j++ {
				if 'A' <= b[j] && b[j] <= 'Z' {
					b[j] += 'a' - 'A'
				}
			}
			return string(b)
		}
	}
	return s
}
