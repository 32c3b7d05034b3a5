package resolver

import (
	"sync"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Per-workload budgets for the queries that must go upstream. Each workload (the
// sender as the datapath attributes it: a pod's container or a VM's systemd unit by
// its cgroup, else its source address) has a token bucket (QPS, Burst) and a cap on
// its queries waiting for the upstream (InFlight). A miss over either is answered
// REFUSED at once and never queued behind anyone; table and cache answers never touch
// a budget. One workload sending unique misses therefore spends its own budget, not
// the node's.

// BudgetLimits is the budget of each workload; a zero field is no limit of that kind.
type BudgetLimits struct {
	// QPS is the rate of queries a workload may send upstream, and Burst how many it
	// may send at once after a quiet spell (default max(QPS, 1)).
	QPS   float64
	Burst int
	// InFlight caps a workload's queries waiting for the upstream.
	InFlight int
}

func (l BudgetLimits) enabled() bool { return l.QPS > 0 || l.InFlight > 0 }

const (
	budgetShards = 64
	// maxBudgets bounds the workloads with a budget entry. An idle entry (a full
	// bucket, nothing in flight) is the same as none and is dropped first; past
	// the bound a new workload is not limited rather than refused.
	maxBudgets = 1 << 16
)

// budgets holds every workload's budget, sharded by workload id.
type budgets struct {
	lim    BudgetLimits
	burst  float64
	now    func() int64 // nanoseconds; tests replace it
	shards [budgetShards]budgetShard
}

type budgetShard struct {
	mu sync.Mutex
	m  map[uint64]*bucket
}

type bucket struct {
	tokens   float64
	last     int64 // nanoseconds of the last refill
	inflight int
}

func newBudgets(lim BudgetLimits) *budgets {
	if !lim.enabled() {
		return nil
	}
	b := &budgets{lim: lim, burst: float64(max(lim.Burst, 1)), now: func() int64 { return time.Now().UnixNano() }}
	if lim.Burst == 0 {
		b.burst = max(lim.QPS, 1)
	}
	for i := range b.shards {
		b.shards[i].m = make(map[uint64]*bucket)
	}
	return b
}

// acquire takes one query of workload k out of its budget, or reports false when it
// is over (then nothing is taken). A nil budgets admits everything.
func (b *budgets) acquire(k workload.Key) bool {
	if b == nil {
		return true
	}
	id := k.ID()
	sh := &b.shards[id%budgetShards]
	now := b.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[id]
	if e == nil {
		if len(sh.m) >= maxBudgets/budgetShards && !sh.dropIdle(b, now) {
			return true // bounded: a workload past the bound is not limited
		}
		e = &bucket{tokens: b.burst, last: now}
		sh.m[id] = e
	}
	if b.lim.InFlight > 0 && e.inflight >= b.lim.InFlight {
		return false
	}
	if b.lim.QPS > 0 {
		b.refill(e, now)
		if e.tokens < 1 {
			return false
		}
		e.tokens--
	}
	e.inflight++
	return true
}

// release returns the in-flight share of a query acquire admitted.
func (b *budgets) release(k workload.Key) {
	if b == nil {
		return
	}
	id := k.ID()
	sh := &b.shards[id%budgetShards]
	sh.mu.Lock()
	if e := sh.m[id]; e != nil && e.inflight > 0 {
		e.inflight--
	}
	sh.mu.Unlock()
}

func (b *budgets) refill(e *bucket, now int64) {
	if b.lim.QPS > 0 && now > e.last {
		e.tokens = min(b.burst, e.tokens+float64(now-e.last)/1e9*b.lim.QPS)
	}
	e.last = now
}

// dropIdle removes the shard's idle entries (nothing in flight, bucket full again) and
// reports whether any went.
func (sh *budgetShard) dropIdle(b *budgets, now int64) bool {
	n := len(sh.m)
	for id, e := range sh.m {
		b.refill(e, now)
		if e.inflight == 0 && (b.lim.QPS == 0 || e.tokens >= b.burst) {
			delete(sh.m, id)
		}
	}
	return len(sh.m) < n
}
