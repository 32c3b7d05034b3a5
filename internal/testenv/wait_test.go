package testenv

import (
	"testing"
	"time"
)

func TestPollHoldsAsSoonAsTheConditionDoes(t *testing.T) {
	n := 0
	if !Poll(time.Second, time.Millisecond, func() bool { n++; return n == 3 }) {
		t.Fatal("Poll gave up on a condition that held on its third test")
	}
	if n != 3 {
		t.Errorf("Poll tested the condition %d times, want 3 (it stops when it holds)", n)
	}
}

func TestPollGivesUpAtTheTimeout(t *testing.T) {
	start := time.Now()
	if Poll(50*time.Millisecond, 5*time.Millisecond, func() bool { return false }) {
		t.Fatal("Poll reported a condition that never held")
	}
	if el := time.Since(start); el < 50*time.Millisecond {
		t.Errorf("Poll gave up after %v, before its 50 ms timeout", el)
	}
}

// fatalRecorder records Fatalf instead of stopping the test.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = format
}

func TestEventuallyFailsOnlyWhenTheConditionNeverHolds(t *testing.T) {
	ok := &fatalRecorder{TB: t}
	Eventually(ok, time.Second, func() bool { return true }, "never")
	if ok.msg != "" {
		t.Errorf("Eventually failed a condition that held: %q", ok.msg)
	}
	bad := &fatalRecorder{TB: t}
	Eventually(bad, 30*time.Millisecond, func() bool { return false }, "never held")
	if bad.msg != "never held" {
		t.Errorf("Eventually did not fail a condition that never held (message %q)", bad.msg)
	}
}
