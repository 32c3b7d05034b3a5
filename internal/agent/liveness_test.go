package agent

import (
	"testing"
	"time"
)

// The liveness monitor: a resolver that reads (busy, idle and probed, or
// reading only now and then) is live; one that leaves the monitor's probe
// unread for livenessStall is wedged, whoever asks and however late the
// monitor looked.
func TestLiveness(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	type step struct {
		at      time.Duration
		read    uint64 // the resolver reads this many datagrams first
		look    bool   // the monitor looks (else: /healthz asks)
		wedged  bool   // check's verdict
		probing bool   // a probe is pending after the step
	}
	for _, tc := range []struct {
		name      string
		readProbe bool // the resolver reads every probe at once
		steps     []step
	}{
		{"busy", false, []step{
			{at: 500 * time.Millisecond, read: 3, look: true},
			{at: 1500 * time.Millisecond, read: 1, look: true},
			{at: 10 * time.Second, read: 1, look: true},
			{at: 10 * time.Second},
		}},
		{"idle, reads the probes", true, []step{
			{at: 500 * time.Millisecond, look: true},
			{at: time.Second, look: true},
			{at: 1500 * time.Millisecond, look: true},
			{at: 2500 * time.Millisecond, look: true, probing: true},
			{at: 20 * time.Second},
		}},
		{"wedged", false, []step{
			{at: time.Second, look: true, probing: true},
			{at: 3 * time.Second, look: true, probing: true},
			{at: 5999 * time.Millisecond, probing: true},
			{at: 6 * time.Second, wedged: true, probing: true},
			{at: 7 * time.Second, look: true, wedged: true, probing: true},
		}},
		{"reads again after a wedge", false, []step{
			{at: time.Second, look: true, probing: true},
			{at: 8 * time.Second, wedged: true, probing: true},
			{at: 8 * time.Second, read: 1, probing: true}, // live before the monitor looks again
			{at: 9 * time.Second, look: true},
		}},
		{"monitor starved while the resolver reads", false, []step{
			{at: time.Second, look: true, probing: true},
			{at: 2 * time.Second, read: 1, probing: true},
			{at: 30 * time.Second, probing: true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var progress uint64
			probes := 0
			l := newLiveness(func() uint64 { return progress }, func() error {
				probes++
				if tc.readProbe {
					progress++
				}
				return nil
			}, t0)
			for i, s := range tc.steps {
				progress += s.read
				if s.look {
					l.look(at(s.at))
				}
				err := l.check(at(s.at))
				if (err != nil) != s.wedged {
					t.Errorf("step %d (%v): check = %v, want wedged %v", i, s.at, err, s.wedged)
				}
				if pending := !l.probedAt.IsZero(); pending != s.probing && !tc.readProbe {
					t.Errorf("step %d (%v): probe pending %v, want %v", i, s.at, pending, s.probing)
				}
			}
			t.Logf("%d probes sent", probes)
		})
	}
}
