// Package handover is the wire protocol between a running agent and its
// successor on the same state directory (docs/design.md, "Upgrades,
// restarts and crashes"): the messages and the descriptors (SCM_RIGHTS) over
// the handover socket. When to hand over or take over, and what to do with
// what was received, is the agent's (internal/agent, takeover.go).
//
// The running agent (A) listens on <state dir>/handover.sock
// (SOCK_SEQPACKET). A successor (B) that finds the state lock held connects
// and:
//
//	B -> A  hello {pid}
//	A -> B  offer {state, listeners, admin, local} + descriptors (SCM_RIGHTS, in chunks):
//	        the state lock, the admin listener, every resolver socket, the
//	        local admin socket's listener (last: an older successor ignores it)
//	B       starts on them: serves the same sockets (both read them for a moment),
//	        adopts the pinned datapath (links get B's programs in place), writes state
//	B -> A  serving {pid}
//	A       stops reading, answers what it read, releases its descriptors only
//
// A serves throughout; B is serving before A stops, and they share the very
// sockets, so no query meets a closed or unserved socket. If B fails before
// "serving", A sees the connection end, puts its own programs and state back
// and goes on serving. If A dies mid-way, B either has the descriptors (it goes
// on alone; A's in-flight queries are lost like in any crash) or it has not (the
// lock is free with A gone: B starts cold).
package handover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
)

// maxFDsPerMessage stays below the kernel's SCM_MAX_FD (253).
const maxFDsPerMessage = 200

// Timeout bounds the handover conversation on both sides, and a successor's
// wait for a running agent to hand over.
const Timeout = 30 * time.Second

type handoverMsg struct {
	Op        string             `json:"op"` // hello, offer, serving, error
	PID       int                `json:"pid,omitempty"`
	Error     string             `json:"error,omitempty"`
	State     *agentstate.State  `json:"state,omitempty"`
	Listeners []handoverListener `json:"listeners,omitempty"`
	Admin     bool               `json:"admin,omitempty"` // the admin listener follows the lock
	Local     bool               `json:"local,omitempty"` // the local admin socket's listener is the last descriptor
	FDs       int                `json:"fds,omitempty"`   // descriptors that follow the offer
}

type handoverListener struct {
	Addr string `json:"addr"`
	UDP  int    `json:"udp"` // UDP sockets; then one TCP listener
}

// Inheritance is what a successor received.
type Inheritance struct {
	From      int                          // the predecessor's pid
	State     *agentstate.State            // the predecessor's state
	Lock      *agentstate.Lock             // the state lock, ours now
	Listeners []resolver.InheritedListener // the resolver's sockets (the caller takes them)
	admin     *os.File
	local     *os.File
	conn      *net.UnixConn // to tell the predecessor we serve
}

// TakeAdmin and TakeLocal hand the caller the inherited admin listener and
// local socket (nil when there is none), which CloseUnused then leaves alone.
func (in *Inheritance) TakeAdmin() *os.File {
	return in.take(func(in *Inheritance) **os.File { return &in.admin })
}
func (in *Inheritance) TakeLocal() *os.File {
	return in.take(func(in *Inheritance) **os.File { return &in.local })
}

func (in *Inheritance) take(field func(*Inheritance) **os.File) *os.File {
	if in == nil {
		return nil
	}
	f := field(in)
	got := *f
	*f = nil
	return got
}

// CloseUnused closes the descriptors nobody took (not the lock).
func (in *Inheritance) CloseUnused() {
	for _, f := range []*os.File{in.admin, in.local} {
		if f != nil {
			f.Close()
		}
	}
	for _, l := range in.Listeners {
		for _, f := range l.UDP {
			f.Close()
		}
		if l.TCP != nil {
			l.TCP.Close()
		}
	}
}

func writeMsg(c *net.UnixConn, m handoverMsg, fds []int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	return err
}

// readMsg reads one message and the descriptors that came with it.
func readMsg(c *net.UnixConn) (handoverMsg, []*os.File, error) {
	var m handoverMsg
	buf := make([]byte, 1<<20)
	oob := make([]byte, unix.CmsgSpace(4*maxFDsPerMessage))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return m, nil, err
	}
	files, err := parseRights(oob[:oobn])
	if err != nil {
		return m, nil, err
	}
	if n == 0 {
		for _, f := range files {
			f.Close()
		}
		return m, nil, errors.New("connection closed")
	}
	if err := json.Unmarshal(buf[:n], &m); err != nil {
		for _, f := range files {
			f.Close()
		}
		return m, nil, fmt.Errorf("handover message: %w", err)
	}
	return m, files, nil
}

func parseRights(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("handover descriptors: %w", err)
	}
	var files []*os.File
	for _, cm := range msgs {
		fds, err := unix.ParseUnixRights(&cm)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "handover"))
		}
	}
	return files, nil
}

// ReadHello reads a successor's first message on c: its pid.
func ReadHello(c *net.UnixConn) (pid int, err error) {
	hello, files, err := readMsg(c)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		return 0, err
	}
	if hello.Op != "hello" {
		return 0, fmt.Errorf("handover: %q where a hello was due", hello.Op)
	}
	return hello.PID, nil
}

// Refuse tells a successor why there is no offer.
func Refuse(c *net.UnixConn, reason string) error {
	return writeMsg(c, handoverMsg{Op: "error", Error: reason}, nil)
}

// Request asks the agent holding the lock of stateDir to hand over. It
// returns ErrRetry when that agent cannot hand over now (not listening yet,
// starting, stopping) or is gone.
func Request(ctx context.Context, stateDir string) (*Inheritance, error) {
	d := net.Dialer{}
	c, err := d.DialContext(ctx, "unixpacket", agentstate.HandoverPath(stateDir))
	if err != nil {
		return nil, fmt.Errorf("%w: connect %s: %v", ErrRetry, agentstate.HandoverPath(stateDir), err)
	}
	uc := c.(*net.UnixConn)
	ok := false
	defer func() {
		if !ok {
			uc.Close()
		}
	}()
	if dl, has := ctx.Deadline(); has {
		_ = uc.SetDeadline(dl)
	} else {
		_ = uc.SetDeadline(time.Now().Add(Timeout))
	}
	if err := writeMsg(uc, handoverMsg{Op: "hello", PID: os.Getpid()}, nil); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrRetry, err)
	}
	offer, files, err := readMsg(uc)
	if err != nil {
		return nil, fmt.Errorf("%w: read the offer: %v", ErrRetry, err)
	}
	if offer.Op != "offer" {
		for _, f := range files {
			f.Close()
		}
		return nil, fmt.Errorf("%w: the running agent declined: %s", ErrRetry, offer.Error)
	}
	for len(files) < offer.FDs {
		_, more, err := readMsg(uc)
		if err != nil {
			for _, f := range files {
				f.Close()
			}
			return nil, fmt.Errorf("%w: read descriptors: %v", ErrRetry, err)
		}
		files = append(files, more...)
	}
	in, err := unpackOffer(offer, files)
	if err != nil {
		for _, f := range files {
			f.Close()
		}
		return nil, err
	}
	_ = uc.SetDeadline(time.Time{})
	in.conn = uc
	ok = true
	return in, nil
}

// ErrRetry marks a handover that may work when tried again.
var ErrRetry = errors.New("handover not possible now")

func unpackOffer(offer handoverMsg, files []*os.File) (*Inheritance, error) {
	if len(files) != offer.FDs || offer.State == nil || len(files) == 0 {
		return nil, fmt.Errorf("handover offer: %d descriptors, %d announced", len(files), offer.FDs)
	}
	in := &Inheritance{From: offer.PID, State: offer.State, Lock: agentstate.Adopt(files[0])}
	files = files[1:]
	if offer.Local && len(files) > 0 {
		in.local, files = files[len(files)-1], files[:len(files)-1]
	}
	if offer.Admin {
		in.admin, files = files[0], files[1:]
	}
	for _, l := range offer.Listeners {
		if len(files) < l.UDP+1 {
			return nil, fmt.Errorf("handover offer: descriptors of %s missing", l.Addr)
		}
		il := resolver.InheritedListener{Addr: l.Addr, UDP: files[:l.UDP], TCP: files[l.UDP]}
		files = files[l.UDP+1:]
		in.Listeners = append(in.Listeners, il)
	}
	return in, nil
}

// Close ends the conversation without serving: the predecessor sees the
// connection end and serves on.
func (in *Inheritance) Close() error { return in.conn.Close() }

// Serving tells the predecessor that we serve: it may stop.
func (in *Inheritance) Serving() error {
	defer in.conn.Close()
	_ = in.conn.SetDeadline(time.Now().Add(5 * time.Second))
	return writeMsg(in.conn, handoverMsg{Op: "serving", PID: os.Getpid()}, nil)
}

// Offer is what the running agent hands over; files are closed by the caller.
type Offer struct {
	State     *agentstate.State
	Lock      *os.File // the state lock's open file
	Admin     *os.File // the admin listener (nil: none)
	Local     *os.File // the local admin socket's listener (nil: none)
	Listeners []resolver.InheritedListener

	DieAfterSend bool // fault injection (tests): SIGKILL ourselves once sent
}

// SendOffer sends the offer and its descriptors, then waits for "serving".
func SendOffer(c *net.UnixConn, o Offer) (successor int, err error) {
	m, fds, err := o.message()
	if err != nil {
		return 0, err
	}
	first := min(len(fds), maxFDsPerMessage)
	if err := writeMsg(c, m, fds[:first]); err != nil {
		return 0, fmt.Errorf("send the offer: %w", err)
	}
	for i := first; i < len(fds); i += maxFDsPerMessage {
		if err := writeMsg(c, handoverMsg{Op: "fds"}, fds[i:min(i+maxFDsPerMessage, len(fds))]); err != nil {
			return 0, fmt.Errorf("send descriptors: %w", err)
		}
	}
	if o.DieAfterSend {
		_ = unix.Kill(os.Getpid(), unix.SIGKILL)
	}
	reply, files, err := readMsg(c)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		return 0, fmt.Errorf("the successor did not start: %w", err)
	}
	if reply.Op != "serving" {
		return 0, fmt.Errorf("the successor did not start: %s %s", reply.Op, reply.Error)
	}
	return reply.PID, nil
}

// message is the offer message and its descriptors, in the order
// unpackOffer takes them: the lock, the admin listener, each listen
// address's UDP sockets and TCP listener, the local socket's listener.
func (o Offer) message() (handoverMsg, []int, error) {
	m := handoverMsg{Op: "offer", PID: os.Getpid(), State: o.State, Admin: o.Admin != nil, Local: o.Local != nil}
	files := []*os.File{o.Lock}
	if o.Admin != nil {
		files = append(files, o.Admin)
	}
	for _, l := range o.Listeners {
		m.Listeners = append(m.Listeners, handoverListener{Addr: l.Addr, UDP: len(l.UDP)})
		files = append(append(files, l.UDP...), l.TCP)
	}
	if o.Local != nil {
		files = append(files, o.Local)
	}
	fds := make([]int, 0, len(files))
	for _, f := range files {
		fd, err := rawFD(f)
		if err != nil {
			return m, nil, fmt.Errorf("handover descriptor %s: %w", f.Name(), err)
		}
		fds = append(fds, fd)
	}
	m.FDs = len(fds)
	return m, fds, nil
}

// rawFD is f's descriptor, valid while f is open. Unlike f.Fd() it leaves
// the open file description's mode alone: Fd switches it to blocking, and
// this process's listener, which shares the description with f and serves
// on until the drain, would then block in accept (and its Close with it).
func rawFD(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	fd := -1
	if err := rc.Control(func(u uintptr) { fd = int(u) }); err != nil {
		return 0, err
	}
	return fd, nil
}

// Listen binds the handover socket, replacing a stale one (ours to
// replace: we hold the lock).
func Listen(stateDir string) (*net.UnixListener, error) {
	p := agentstate.HandoverPath(stateDir)
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("replace %s: %w", p, err)
	}
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: p, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", p, err)
	}
	_ = os.Chmod(p, 0o600)
	l.SetUnlinkOnClose(false) // a successor may have bound the path again
	return l, nil
}
