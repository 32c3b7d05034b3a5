package testenv

import (
	"testing"
	"time"
)

// PollInterval is how often WaitFor and Eventually test their condition.
const PollInterval = 20 * time.Millisecond

// WaitFor polls cond every PollInterval until it holds or timeout passes, and
// reports whether it held.
func WaitFor(timeout time.Duration, cond func() bool) bool {
	return Poll(timeout, PollInterval, cond)
}

// Poll tests cond every interval until it holds or timeout passes (cond is
// tested once more at the deadline), and reports whether it held. A test that
// measures how soon something happens polls with a short interval.
func Poll(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval)
	}
}

// Eventually fails the test (t.Fatalf with format and args) unless cond holds
// within timeout. Args are formatted when it fails, so a fmt.Stringer such as
// a process's log shows what was written by then.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, format string, args ...any) {
	t.Helper()
	if !WaitFor(timeout, cond) {
		t.Fatalf(format, args...)
	}
}
