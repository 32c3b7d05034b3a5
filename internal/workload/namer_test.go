package workload

import (
	"testing"
	"time"
)

// Learn runs on the query path (once per workload per counting period): for
// a cgroup already named it must neither lock nor allocate, so a slow Name
// (a walk of the cgroup tree, a scrape naming every workload) never holds a
// query up.
func TestLearnKnownCgroupTakesNoLock(t *testing.T) {
	n := NewNamer(nil)
	k := Key{Cgroup: 4242, PID: 7}
	n.remember(k.Cgroup, "/system.slice/app.service")
	if a := testing.AllocsPerRun(100, func() { n.Learn(k) }); a != 0 {
		t.Errorf("Learn of a named cgroup: %v allocations", a)
	}
	n.mu.Lock() // as a Name that is walking the tree
	done := make(chan struct{})
	go func() {
		n.Learn(k)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Error("Learn of a named cgroup waited for the namer's lock")
	}
	n.mu.Unlock()
	<-done
}
