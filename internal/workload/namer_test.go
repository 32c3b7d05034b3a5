package workload

import (
	"net/netip"
	"strings"
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

type fakePods map[string]Pod

func (f fakePods) PodByUID(uid string) (Pod, bool) { p, ok := f[uid]; return p, ok }
func (f fakePods) PodByIP(netip.Addr) (Pod, bool)  { return Pod{}, false }

// Known never names a cgroup itself: an unnamed one reports false (and is
// queued for the background naming); once named it is the pod's.
func TestKnownDoesNotWalk(t *testing.T) {
	const uid = "0c4f7e2a-1b2c-4d5e-8f90-123456789abc"
	n := NewNamer(fakePods{uid: {Namespace: "team-a", Name: "api-0", UID: uid}})
	k := Key{Cgroup: 4343}
	if id, ok := n.Known(k); ok {
		t.Fatalf("Known of a cgroup not named yet = %+v, true; want false", id)
	}
	if len(n.learn) != 1 {
		t.Errorf("Known of a cgroup not named yet queued %d keys to learn, want 1", len(n.learn))
	}
	n.remember(k.Cgroup, "/kubepods.slice/kubepods-pod"+strings.ReplaceAll(uid, "-", "_")+".slice/cri-containerd-abc.scope")
	id, ok := n.Known(k)
	if !ok || id.Namespace != "team-a" || id.Pod != "api-0" {
		t.Errorf("Known of the named cgroup = %+v, %v; want team-a/api-0", id, ok)
	}
}
