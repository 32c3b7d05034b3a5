package tap

import "sync/atomic"

// ring is a bounded queue of events with many writers (the resolver's
// threads) and one reader (the subscriber's connection): a writer claims a
// slot with one compare-and-swap and never waits; when the reader lags a
// whole ring behind, the writer drops the event and counts it. Each slot's
// sequence number says whose turn it is (D. Vyukov's bounded queue).
type ring struct {
	mask  uint64
	slots []ringSlot
	_     [64]byte
	head  atomic.Uint64 // next position to write
	_     [56]byte
	tail  uint64 // next position to read (the reader only)
	lost  atomic.Uint64
}

type ringSlot struct {
	seq atomic.Uint64 // pos: free for the writer of pos; pos+1: holds pos's event
	ev  Event
}

// newRing makes a ring of size slots (a power of two).
func newRing(size int) *ring {
	r := &ring{mask: uint64(size - 1), slots: make([]ringSlot, size)}
	for i := range r.slots {
		r.slots[i].seq.Store(uint64(i))
	}
	return r
}

// put copies ev into the ring, or counts it lost when the ring is full.
func (r *ring) put(ev *Event) {
	pos := r.head.Load()
	for {
		s := &r.slots[pos&r.mask]
		seq := s.seq.Load()
		switch d := int64(seq - pos); {
		case d == 0:
			if r.head.CompareAndSwap(pos, pos+1) {
				s.ev = *ev
				s.seq.Store(pos + 1)
				return
			}
			pos = r.head.Load()
		case d < 0:
			r.lost.Add(1) // the reader has not freed this slot: full
			return
		default:
			pos = r.head.Load() // another writer took pos
		}
	}
}

// get moves the next event into ev; false when there is none (yet).
func (r *ring) get(ev *Event) bool {
	s := &r.slots[r.tail&r.mask]
	if s.seq.Load() != r.tail+1 {
		return false
	}
	*ev = s.ev
	s.seq.Store(r.tail + r.mask + 1)
	r.tail++
	return true
}
