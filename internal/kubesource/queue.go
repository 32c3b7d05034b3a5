package kubesource

import (
	"context"
	"sync"
)

// keyQueue holds the keys whose hosts must be recomputed. Event handlers of
// any informer add keys; workers take them. A key is never handed to two
// workers at once, and a key added while a worker has it is handed out
// again once that worker is done. So the last computation of every key
// starts after the last change that added it: what a source publishes is a
// function of its informers' final state, whatever the order of events and
// of the handlers' goroutines.
type keyQueue struct {
	mu      sync.Mutex
	cond    *sync.Cond
	dirty   map[string]bool // queued or to be queued again after its worker is done
	busy    map[string]bool // held by a worker
	order   []string        // dirty keys not held by a worker, oldest first
	peak    int             // largest len(dirty) since the queue was last empty
	adds    uint64          // calls of add, for telling a quiet moment
	stopped bool
}

func newKeyQueue() *keyQueue {
	q := &keyQueue{dirty: map[string]bool{}, busy: map[string]bool{}}
	q.cond = sync.NewCond(&q.mu)
	return q
}

// add marks key for recomputation ("" is ignored).
func (q *keyQueue) add(key string) {
	if key == "" {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.adds++
	q.cond.Broadcast() // waitAdded
	if q.dirty[key] {
		return
	}
	q.dirty[key] = true
	q.peak = max(q.peak, len(q.dirty))
	if !q.busy[key] {
		q.order = append(q.order, key)
	}
}

// get waits for a key and hands it to the caller until done(key). It
// returns false once the queue is stopped.
func (q *keyQueue) get() (string, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.order) == 0 && !q.stopped {
		q.cond.Wait()
	}
	if q.stopped {
		return "", false
	}
	key := q.order[0]
	q.order[0] = ""
	q.order = q.order[1:]
	delete(q.dirty, key)
	q.busy[key] = true
	return key, true
}

// done releases key; if it was added meanwhile, it is queued again.
func (q *keyQueue) done(key string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	delete(q.busy, key)
	if q.dirty[key] {
		q.order = append(q.order, key)
	}
	if len(q.dirty) == 0 && len(q.busy) == 0 {
		q.shrink()
	}
	q.cond.Broadcast()
}

// shrink drops the maps and the slice a burst (the initial lists) grew:
// Go maps keep their buckets. q.mu is held.
func (q *keyQueue) shrink() {
	if q.peak > 1024 {
		q.dirty, q.busy, q.order = map[string]bool{}, map[string]bool{}, nil
	}
	q.peak = 0
}

// idle waits until no key is queued or held, or ctx ends (false).
func (q *keyQueue) idle(ctx context.Context) bool {
	return q.wait(ctx, func() bool { return len(q.dirty) == 0 && len(q.busy) == 0 })
}

// wait waits until done (called with q.mu held) holds, or ctx ends or the
// queue stops (false).
func (q *keyQueue) wait(ctx context.Context, done func() bool) bool {
	stop := context.AfterFunc(ctx, func() {
		q.mu.Lock()
		defer q.mu.Unlock()
		q.cond.Broadcast()
	})
	defer stop()
	q.mu.Lock()
	defer q.mu.Unlock()
	for !done() {
		if ctx.Err() != nil || q.stopped {
			return false
		}
		q.cond.Wait()
	}
	return true
}

// added is the number of add calls so far.
func (q *keyQueue) added() uint64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.adds
}

// waitAdded waits until add was called more than n times in all, or ctx
// ends (false).
func (q *keyQueue) waitAdded(ctx context.Context, n uint64) bool {
	return q.wait(ctx, func() bool { return q.adds > n })
}

// stop wakes every waiter; get returns false from now on.
func (q *keyQueue) stop() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.stopped = true
	q.cond.Broadcast()
}
