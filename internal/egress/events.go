package egress

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"time"
	"unsafe"

	"github.com/cilium/ebpf/ringbuf"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// Verdict is what the programs did with a connect or send no grant allowed.
type Verdict uint8

// Verdicts of an Event.
const (
	Denied  = Verdict(redirect.VerdictDenied)  // refused with EPERM (enforce)
	Audited = Verdict(redirect.VerdictAudited) // allowed and recorded (audit)
)

func (v Verdict) String() string {
	switch v {
	case Denied:
		return "denied"
	case Audited:
		return "audited"
	}
	return "unknown"
}

// Event is one denied or audited connect or send.
type Event struct {
	Time     time.Time // when the program decided (from its CLOCK_MONOTONIC stamp)
	Cgroup   uint64    // cgroup v2 id of the task
	Workload WorkloadID
	Dst      netip.AddrPort // IPv4 unmapped
	Proto    Proto
	Verdict  Verdict
}

// Events is the stream of denied and audited connects. When the reader falls
// behind, events are dropped: those the ring buffer had no room for are
// counted per workload (Counts.EventsDropped), those the channel had no room
// for in EventsLost. It is closed by Close.
func (e *Egress) Events() <-chan Event { return e.events }

// EventsLost is how many events were dropped because the Events channel was full.
func (e *Egress) EventsLost() uint64 { return e.lost.Load() }

const eventSize = int(unsafe.Sizeof(redirect.EgressEvent{}))

// readEvents turns ring buffer records into Events until the reader closes.
func (e *Egress) readEvents() {
	defer e.done.Done()
	defer close(e.events)
	var rec ringbuf.Record
	for {
		if err := e.reader.ReadInto(&rec); err != nil {
			if errors.Is(err, ringbuf.ErrClosed) || errors.Is(err, os.ErrClosed) {
				return
			}
			e.log.Warn("egress: read an event", "err", err)
			continue
		}
		ev, ok := decodeEvent(rec.RawSample)
		if !ok {
			continue
		}
		select {
		case e.events <- ev:
		default:
			e.lost.Add(1)
		}
	}
}

func decodeEvent(b []byte) (Event, bool) {
	if len(b) < eventSize {
		return Event{}, false
	}
	var raw redirect.EgressEvent
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&raw)), eventSize), b)
	var a16 [16]byte
	for i, w := range raw.Addr {
		binary.NativeEndian.PutUint32(a16[4*i:], w)
	}
	return Event{
		Time:     monotonicTime(int64(raw.Time)),
		Cgroup:   raw.CgroupId,
		Workload: WorkloadID(raw.Workload),
		Dst:      netip.AddrPortFrom(netip.AddrFrom16(a16).Unmap(), raw.Port),
		Proto:    Proto(raw.Proto),
		Verdict:  Verdict(raw.Verdict),
	}, true
}

// addrWords is a's key words: IPv4 as ::ffff:a.b.c.d, in memory order.
func addrWords(a netip.Addr) [4]uint32 {
	b := a.Unmap().As16()
	var w [4]uint32
	for i := range w {
		w[i] = binary.NativeEndian.Uint32(b[4*i:])
	}
	return w
}
