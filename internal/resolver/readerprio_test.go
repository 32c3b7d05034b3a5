package resolver

import (
	"testing"
	"time"
)

// A reader may run at real-time priority while its work in the current window
// is within its share; past it, not until the next window begins.
func TestRealtimeShareOfAWindow(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	type batch struct {
		start, end time.Duration // from t0
		rt         bool          // real-time allowed after the batch
	}
	for _, tc := range []struct {
		name    string
		batches []batch
	}{
		{"short batches stay within the share", []batch{
			{0, 100 * time.Microsecond, true},
			{time.Millisecond, 1100 * time.Microsecond, true},
			{2 * time.Millisecond, 2200 * time.Microsecond, true},
		}},
		{"a long batch is over it", []batch{
			{0, 6 * time.Millisecond, false},
		}},
		{"many short batches add up", []batch{
			{0, 2 * time.Millisecond, true},
			{2 * time.Millisecond, 4 * time.Millisecond, true},
			{4 * time.Millisecond, 6 * time.Millisecond, false},
			{6 * time.Millisecond, 6100 * time.Microsecond, false},
		}},
		{"the next window starts afresh", []batch{
			{0, 6 * time.Millisecond, false},
			{7 * time.Millisecond, 8 * time.Millisecond, false},
			{10 * time.Millisecond, 10100 * time.Microsecond, true},
		}},
		{"an idle reader's next window begins at its next batch", []batch{
			{0, 4 * time.Millisecond, true},
			{time.Second, time.Second + 4*time.Millisecond, true},
			{time.Second + 5*time.Millisecond, time.Second + 8*time.Millisecond, false},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newRTShare(0.5, 10*time.Millisecond)
			for i, b := range tc.batches {
				g.begin(at(b.start))
				if got := g.end(at(b.start), at(b.end)); got != b.rt {
					t.Errorf("batch %d (%v-%v): real-time %v, want %v", i, b.start, b.end, got, b.rt)
				}
			}
		})
	}
}
