package egress

import (
	"time"

	"golang.org/x/sys/unix"
)

// The programs read CLOCK_MONOTONIC (bpf_ktime_get_ns). Go's monotonic clock
// reads the same clock but from an unknown origin, so the offset is taken
// once and later readings cost what time.Since costs (no system call).
var (
	monoBase  int64     // CLOCK_MONOTONIC at monoStart
	monoStart time.Time // with its monotonic reading
)

func init() {
	var ts unix.Timespec
	monoStart = time.Now()
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err == nil {
		monoBase = ts.Nano()
	}
}

// monotonicNow is CLOCK_MONOTONIC in nanoseconds, as bpf_ktime_get_ns reads it.
func monotonicNow() int64 { return monoBase + int64(time.Since(monoStart)) }

// monotonicTime is the wall time of a CLOCK_MONOTONIC stamp.
func monotonicTime(ns int64) time.Time { return monoStart.Add(time.Duration(ns - monoBase)) }
