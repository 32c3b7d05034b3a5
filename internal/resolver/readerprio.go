package resolver

import "time"

// The UDP readers' real-time share (Config.ReaderRealtime): a reader runs at
// real-time priority while its work in the current window is within its share
// of the window, and at its nice value for the rest of a window it overran.
// The accounting is here; setting the thread's priority is per platform
// (readerprio_linux.go).

// DefaultReaderRealtimeShare is the share of a CPU a UDP reader may use at
// real-time priority when Config.ReaderRealtimeShare is 0.
const DefaultReaderRealtimeShare = 0.5

// readerRealtimeWindow is the window a reader's real-time share is counted
// over: at most share × window at real-time priority at a time.
const readerRealtimeWindow = 10 * time.Millisecond

// rtShare is one reader's use of its real-time share in the current window.
type rtShare struct {
	window, allowed time.Duration
	start           time.Time // of the current window
	used            time.Duration
}

func newRTShare(share float64, window time.Duration) rtShare {
	return rtShare{window: window, allowed: time.Duration(share * float64(window))}
}

// begin starts a batch of work at now, and a new window when the current one
// is over (an idle reader's next window begins at its next batch). It reports
// whether the reader may run the batch at real-time priority.
func (g *rtShare) begin(now time.Time) bool {
	if now.Sub(g.start) >= g.window {
		g.start, g.used = now, 0
	}
	return g.used <= g.allowed
}

// end counts the batch begun at start and ended at now, and reports whether
// the reader may still run at real-time priority in this window.
func (g *rtShare) end(start, now time.Time) bool {
	g.used += now.Sub(start)
	return g.used <= g.allowed
}
