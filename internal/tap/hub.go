package tap

import (
	"errors"
	"sync"
	"sync/atomic"
)

// DefaultRing is the records a subscriber's ring holds (368 bytes each with
// its sequence number: 1.5 MB per subscriber, allocated when it subscribes):
// a reader that falls this far behind loses the next ones.
const DefaultRing = 4096

// DefaultMaxSubscribers bounds the subscribers at once.
const DefaultMaxSubscribers = 8

// Hub hands published events to its subscribers. Publish never blocks and
// never allocates; with no subscriber it is one atomic load.
type Hub struct {
	subs atomic.Pointer[[]*Sub] // copy on write
	mu   sync.Mutex
	max  int
	ring int
	lost atomic.Uint64 // over every subscriber, ever
}

// NewHub returns a hub for at most maxSubs subscribers, each with a ring of
// ringSize events (rounded up to a power of two); 0 means the default.
func NewHub(maxSubs, ringSize int) *Hub {
	if maxSubs <= 0 {
		maxSubs = DefaultMaxSubscribers
	}
	if ringSize <= 0 {
		ringSize = DefaultRing
	}
	size := 1
	for size < ringSize {
		size <<= 1
	}
	return &Hub{max: maxSubs, ring: size}
}

// Active reports whether anyone is subscribed (then Publish wants events).
func (h *Hub) Active() bool {
	if h == nil {
		return false
	}
	p := h.subs.Load()
	return p != nil && len(*p) > 0
}

// Publish offers ev to every subscriber whose filter takes it. ev is copied.
func (h *Hub) Publish(ev *Event) {
	p := h.subs.Load()
	if p == nil {
		return
	}
	for _, s := range *p {
		if s.f.matchEvent(ev) {
			s.r.put(ev)
		}
	}
}

// Subscribers is how many are subscribed now.
func (h *Hub) Subscribers() int {
	p := h.subs.Load()
	if p == nil {
		return 0
	}
	return len(*p)
}

// Lost is how many events subscribers lost because they read too slowly, in
// total since the hub was made.
func (h *Hub) Lost() uint64 {
	n := h.lost.Load()
	if p := h.subs.Load(); p != nil {
		for _, s := range *p {
			n += s.r.lost.Load()
		}
	}
	return n
}

// ErrTooMany is returned when the hub has its maximum of subscribers.
var ErrTooMany = errors.New("too many tap subscribers")

// Sub is one subscriber: its filter and its ring. Next, TakeLost and Close
// belong to one goroutine (the reader).
type Sub struct {
	h    *Hub
	f    Filter
	r    *ring
	seen uint64 // lost events already reported by TakeLost
}

// Subscribe adds a subscriber that gets the events f selects.
func (h *Hub) Subscribe(f Filter) (*Sub, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var cur []*Sub
	if p := h.subs.Load(); p != nil {
		cur = *p
	}
	if len(cur) >= h.max {
		return nil, ErrTooMany
	}
	s := &Sub{h: h, f: f, r: newRing(h.ring)}
	next := append(append(make([]*Sub, 0, len(cur)+1), cur...), s)
	h.subs.Store(&next)
	return s, nil
}

// Next moves the next event into ev; false when none is waiting.
func (s *Sub) Next(ev *Event) bool { return s.r.get(ev) }

// TakeLost returns how many events were lost since the last call.
func (s *Sub) TakeLost() uint64 {
	n := s.r.lost.Load()
	d := n - s.seen
	s.seen = n
	return d
}

// Filter is what the subscriber asked for.
func (s *Sub) Filter() Filter { return s.f }

// Close removes the subscriber.
func (s *Sub) Close() {
	h := s.h
	h.mu.Lock()
	defer h.mu.Unlock()
	p := h.subs.Load()
	if p == nil {
		return
	}
	next := make([]*Sub, 0, len(*p))
	for _, o := range *p {
		if o != s {
			next = append(next, o)
		}
	}
	if len(next) != len(*p) {
		h.lost.Add(s.r.lost.Load())
	}
	h.subs.Store(&next)
}
