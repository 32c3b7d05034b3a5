package workload

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// maxCgroups bounds the cgroup names a Namer remembers.
const maxCgroups = 1 << 16

// learnQueue is how many keys Learn holds for the background naming; more are
// named when asked.
const learnQueue = 4096

// knownSlots is the size of the lock-free set of named cgroup ids Learn
// checks first (128 KiB); knownProbes is how far an id may sit from its slot.
const (
	knownBits   = 14
	knownSlots  = 1 << knownBits
	knownProbes = 8
)

// Namer turns Keys into Identities. A cgroup id is named once, by the process
// that sent (/proc/PID/cgroup, checked against the id) or else by a walk of
// the cgroup2 tree, and keeps its name after the cgroup is removed, so the
// queries it sent just before are still named; an id is never reused, and an
// id that was gone when first asked stays "cgroup:ID". Learn, which the query
// path calls for keys it has not counted for a while, names new cgroups at
// once in the background, while they still exist. Pods are looked up in the
// pod index every time (they come and go; their cgroup paths carry their UID).
//
// Lifecycle: NewNamer validates, Start finds the cgroup2 mount and starts the
// background naming, Close stops it. Name works without Start (it then names
// what it can synchronously). Safe for concurrent use.
type Namer struct {
	pods  PodIndex // nil: no pods (not in Kubernetes mode)
	mount string
	walk  *cgroup2.Namer

	mu    sync.Mutex
	paths map[uint64]string // cgroup id -> path from the mount ("" once found gone)
	// known holds ids with a path, without a lock, so that Learn on the query
	// path costs a few loads for them (ids are never reused; a full
	// neighbourhood leaves an id to the map).
	known [knownSlots]atomic.Uint64

	learn chan Key
	stop  context.CancelFunc
	done  chan struct{}
}

// NewNamer returns a Namer that names pods from pods (nil: none).
func NewNamer(pods PodIndex) *Namer {
	return &Namer{pods: pods, walk: cgroup2.NewNamer(), paths: map[uint64]string{}, learn: make(chan Key, learnQueue)}
}

// Start finds the cgroup2 mount and starts naming learned keys.
func (n *Namer) Start(ctx context.Context) error {
	// Without a cgroup2 mount (iptables mode on a host or in a container
	// without one) no query carries a cgroup id: senders are named by
	// address, and the mount is looked for again when an id comes.
	mount, _ := cgroup2.FindMount()
	n.mu.Lock()
	n.mount = mount
	n.mu.Unlock()
	lctx, cancel := context.WithCancel(context.Background())
	n.stop, n.done = cancel, make(chan struct{})
	go n.learner(lctx)
	return nil
}

// Close stops the background naming. Idempotent.
func (n *Namer) Close() error {
	if n.stop != nil {
		n.stop()
		<-n.done
		n.stop = nil
	}
	return nil
}

// Learn names k's cgroup while it still exists: at once through the sending
// process when it is visible here (one read of /proc/PID/cgroup, once per
// cgroup: a short-lived cgroup may be gone before any background work runs),
// else in the background (a walk). It never blocks on a walk; a full queue
// drops the request (the key is named when asked).
func (n *Namer) Learn(k Key) {
	if k.Cgroup == 0 || n.isKnown(k.Cgroup) {
		return
	}
	n.mu.Lock()
	_, known := n.paths[k.Cgroup]
	mount := n.mount
	n.mu.Unlock()
	if known {
		return
	}
	if k.PID != 0 && mount != "" {
		if rel, err := procCgroup(k.PID); err == nil && inodeOf(filepath.Join(mount, rel)) == k.Cgroup {
			n.remember(k.Cgroup, rel)
			return
		}
	}
	select {
	case n.learn <- k:
	default:
	}
}

func (n *Namer) learner(ctx context.Context) {
	defer close(n.done)
	for {
		select {
		case <-ctx.Done():
			return
		case k := <-n.learn:
			n.cgroupPath(k.Cgroup, k.PID)
		}
	}
}

// Name names k's sender.
func (n *Namer) Name(k Key) Identity {
	if k.Cgroup != 0 {
		return n.nameCgroup(k)
	}
	if n.pods != nil && k.Addr.IsValid() {
		if p, ok := n.pods.PodByIP(k.Addr); ok {
			id := podIdentity(p, "")
			id.By = "address"
			return id
		}
	}
	return Identity{Workload: Unknown}
}

// Known names k's sender without blocking: like Name, but a cgroup not named
// yet is not looked for here (Learn is told of it, so a later call names it)
// and reports false. For callers on the query path (per-workload budgets).
func (n *Namer) Known(k Key) (Identity, bool) {
	if k.Cgroup == 0 {
		return n.Name(k), true
	}
	n.mu.Lock()
	_, ok := n.paths[k.Cgroup]
	n.mu.Unlock()
	if !ok {
		// Learn names it at once when the sender's /proc entry says
		// which cgroup it is (no walk), else queues it.
		if n.Learn(k); !n.isKnown(k.Cgroup) {
			return Identity{}, false
		}
	}
	return n.nameCgroup(k), true
}

func (n *Namer) nameCgroup(k Key) Identity {
	path := n.cgroupPath(k.Cgroup, k.PID)
	id := Identity{Workload: path, Cgroup: path}
	if path == "" {
		id.Workload = removedName(k.Cgroup)
	} else if uid := PodUID(path); uid != "" && n.pods != nil {
		if p, ok := n.pods.PodByUID(uid); ok {
			id = podIdentity(p, path)
			id.Cgroup = path
		}
	}
	id.CgroupID, id.PID, id.By = k.Cgroup, k.PID, "cgroup"
	return id
}

// cgroupPath returns the path (from the cgroup2 mount) of cgroup id, naming
// it first when it is new; "" when it was gone by then.
func (n *Namer) cgroupPath(id uint64, pid uint32) string {
	n.mu.Lock()
	p, ok := n.paths[id]
	mount := n.mount
	n.mu.Unlock()
	if ok {
		return p
	}
	if mount == "" {
		m, err := cgroup2.FindMount()
		if err != nil {
			return ""
		}
		mount = m
	}
	return n.remember(id, n.find(mount, id, pid))
}

// remember stores the path of cgroup id ("" once found gone) and returns what
// is stored: a name found meanwhile by another caller is kept over "".
func (n *Namer) remember(id uint64, p string) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	if old, ok := n.paths[id]; ok && old != "" {
		return old
	}
	if len(n.paths) >= maxCgroups {
		for k := range n.paths { // forget a quarter, at random
			delete(n.paths, k)
			if len(n.paths) < maxCgroups*3/4 {
				break
			}
		}
	}
	n.paths[id] = p
	if p != "" {
		n.markKnown(id)
	}
	return p
}

// knownSlot is where id's neighbourhood in known starts.
func knownSlot(id uint64) uint64 { return (id * 0x9e3779b97f4a7c15) >> (64 - knownBits) }

// isKnown reports whether id has a path (without the lock).
func (n *Namer) isKnown(id uint64) bool {
	h := knownSlot(id)
	for i := range uint64(knownProbes) {
		switch n.known[(h+i)&(knownSlots-1)].Load() {
		case id:
			return true
		case 0:
			return false
		}
	}
	return false
}

// markKnown adds id to known (called under mu).
func (n *Namer) markKnown(id uint64) {
	h := knownSlot(id)
	for i := range uint64(knownProbes) {
		s := &n.known[(h+i)&(knownSlots-1)]
		if v := s.Load(); v == id || (v == 0 && s.CompareAndSwap(0, id)) {
			return
		}
	}
}

// find looks cgroup id up: through the process that sent, else a walk.
func (n *Namer) find(mount string, id uint64, pid uint32) string {
	if pid != 0 {
		if rel, err := procCgroup(pid); err == nil && inodeOf(filepath.Join(mount, rel)) == id {
			return rel
		}
	}
	abs, ok := n.walk.Paths([]uint64{id})[id]
	if !ok {
		return ""
	}
	rel := strings.TrimPrefix(abs, mount)
	if rel == "" {
		rel = "/"
	}
	return rel
}

// procCgroup reads the cgroup v2 path of process pid ("0::/a/b").
func procCgroup(pid uint32) (string, error) {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/cgroup")
	if err != nil {
		return "", err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return rest, nil
		}
	}
	return "", errors.New("no cgroup v2 line")
}

func inodeOf(p string) uint64 {
	fi, err := os.Stat(p)
	if err != nil {
		return 0
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Ino
	}
	return 0
}
