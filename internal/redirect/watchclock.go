package redirect

import (
	"fmt"
	"time"

	"github.com/cilium/ebpf"
)

// The watch clock (bpf/redirect.c, MESHDNS_WATCH_CLOCK): a BPF timer that
// takes the programs' look at the resolver's progress every 10 ms, so a stall
// is timed from the resolver's last dequeue even while no query is being
// redirected. Without it (BPF timers need Linux 5.15) a stall is timed from
// the first query the resolver leaves unread, and a client that asks rarely
// sends one more query to a frozen resolver before it is bypassed.

// watchClock is a running clock. The kernel cancels its timer when the last
// descriptor of its map is closed: it lives as long as this process holds it.
type watchClock struct {
	clock *ebpf.Map
}

// clockFresh is how recent the clock's last tick must be for it to count as
// running: a few ticks.
const clockFresh = 100 * time.Millisecond

// clockRunning reports whether a clock ticked at tick (bpf_ktime_get_ns; 0:
// never) recently, seen at now.
func clockRunning(tick, now uint64) bool {
	return tick != 0 && now >= tick && time.Duration(now-tick) < clockFresh
}

// clockStartPacket is the smallest input a socket filter test run takes (an
// Ethernet header); the start program does not read it.
var clockStartPacket = make([]byte, 14)

// startWatchClock loads the clock on the datapath's config and progress maps
// and starts its timer.
func startWatchClock(config, progress *ebpf.Map) (*watchClock, error) {
	spec, err := loadWatchclock()
	if err != nil {
		return nil, fmt.Errorf("load the watch clock object: %w", err)
	}
	var objs struct {
		Start *ebpf.Program `ebpf:"watch_clock_start"`
		Clock *ebpf.Map     `ebpf:"watch_clock"`
	}
	opts := &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{"config": config, "progress": progress}}
	if err := spec.LoadAndAssign(&objs, opts); err != nil {
		return nil, fmt.Errorf("load the watch clock (BPF timers need Linux 5.15): %w", err)
	}
	// The timer holds the program it calls back: our descriptor can go.
	defer objs.Start.Close()
	ret, err := objs.Start.Run(&ebpf.RunOptions{Data: clockStartPacket})
	if err == nil && ret != 0 {
		err = fmt.Errorf("the start program returned %d", ret)
	}
	if err != nil {
		objs.Clock.Close()
		return nil, fmt.Errorf("start the watch clock: %w", err)
	}
	return &watchClock{clock: objs.Clock}, nil
}

// close stops the clock (this process's descriptor is the only one).
func (w *watchClock) close() error {
	if w == nil {
		return nil
	}
	return w.clock.Close()
}
