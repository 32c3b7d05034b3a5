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

// burstTokens is the bucket's size: Burst, or one second's worth of QPS (at least 1).
func (l BudgetLimits) burstTokens() float64 {
	if l.Burst > 0 {
		return float64(l.Burst)
	}
	return max(l.QPS, 1)
}

// BudgetOverrides gives a workload a budget of its own instead of the default
// (internal/budgetoverride reads it from Pod and Namespace annotations). LimitsFor
// reports false for a workload without one, or not known yet; it is asked when a
// workload's bucket is made and again every budgetRecheck while the bucket lives, off
// the shard's lock, so it must be cheap and must not block (no API calls, no cgroup
// walks).
type BudgetOverrides interface {
	LimitsFor(workload.Key) (BudgetLimits, bool)
}

const (
	budgetShards = 64
	// maxBudgets bounds the workloads with a budget entry. An idle entry (a full
	// bucket, nothing in flight) is the same as none and is dropped first; past
	// the bound a new workload is not limited rather than refused.
	maxBudgets = 1 << 16
	// budgetRecheck is how often a bucket's limits are asked of the overrides
	// again: an annotation changed, or a cgroup named since, applies within it.
	budgetRecheck = time.Second
)

// budgets holds every workload's budget, sharded by workload id.
type budgets struct {
	lim    BudgetLimits    // the default
	ov     BudgetOverrides // nil: every workload has the default
	now    func() int64    // nanoseconds; tests replace it
	shards [budgetShards]budgetShard
}

type budgetShard struct {
	mu sync.Mutex
	m  map[uint64]*bucket
}

type bucket struct {
	lim      BudgetLimits
	burst    float64 // lim.burstTokens()
	checked  int64   // nanoseconds when lim was last asked of the overrides
	tokens   float64
	last     int64 // nanoseconds of the last refill
	inflight int
}

// newBudgets returns the budgets, or nil when no workload can have one (no default
// limit and no overrides).
func newBudgets(lim BudgetLimits, ov BudgetOverrides) *budgets {
	if !lim.enabled() && ov == nil {
		return nil
	}
	b := &budgets{lim: lim, ov: ov, now: func() int64 { return time.Now().UnixNano() }}
	for i := range b.shards {
		b.shards[i].m = make(map[uint64]*bucket)
	}
	return b
}

// limitsFor is workload k's budget: its override, else the default.
func (b *budgets) limitsFor(k workload.Key) BudgetLimits {
	if b.ov != nil {
		if l, ok := b.ov.LimitsFor(k); ok {
			return l
		}
	}
	return b.lim
}

// setLimits gives e the limits lim (at now). A larger burst adds the difference to
// its tokens (a raised budget applies at once, not only as the rate refills it); a
// smaller one caps them.
func (e *bucket) setLimits(lim BudgetLimits, now int64) {
	burst := lim.burstTokens()
	if burst > e.burst {
		e.tokens += burst - e.burst
	}
	e.lim, e.burst, e.checked = lim, burst, now
	e.tokens = min(e.tokens, e.burst)
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
	if e == nil || (b.ov != nil && now-e.checked >= int64(budgetRecheck)) {
		// Ask the overrides without the lock (other workloads of the shard go on);
		// the workload's other queries meanwhile keep its current limits.
		if e != nil {
			e.checked = now
		}
		sh.mu.Unlock()
		lim := b.limitsFor(k)
		sh.mu.Lock()
		if e = sh.m[id]; e != nil {
			b.refill(e, now)
			e.setLimits(lim, now)
		} else {
			if len(sh.m) >= maxBudgets/budgetShards && !sh.dropIdle(b, now) {
				return true // bounded: a workload past the bound is not limited
			}
			e = &bucket{last: now}
			e.setLimits(lim, now) // a full bucket
			sh.m[id] = e
		}
	}
	if e.lim.InFlight > 0 && e.inflight >= e.lim.InFlight {
		return false
	}
	if e.lim.QPS > 0 {
		b.refill(e, now)
		if e.tokens < 1 {
			return false
		}
		e.tokens--
	}
	e.inflight++
	return true
}

// retry takes one token of the budget of the workload with id for a retry of an
// upstream attempt (upstream.Forwarder.SetRetryBudget), or reports false when its
// bucket is empty. A workload without a budget entry, or without a rate, is allowed.
// A retry holds no place of its own in the in-flight cap: its query already does.
func (b *budgets) retry(id uint64) bool {
	sh := &b.shards[id%budgetShards]
	now := b.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[id]
	if e == nil || e.lim.QPS == 0 {
		return true
	}
	b.refill(e, now)
	if e.tokens < 1 {
		return false
	}
	e.tokens--
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
	if e.lim.QPS > 0 && now > e.last {
		e.tokens = min(e.burst, e.tokens+float64(now-e.last)/1e9*e.lim.QPS)
	}
	if now > e.last {
		e.last = now
	}
}

// dropIdle removes the shard's idle entries (nothing in flight, bucket full again) and
// reports whether any went.
func (sh *budgetShard) dropIdle(b *budgets, now int64) bool {
	n := len(sh.m)
	for id, e := range sh.m {
		b.refill(e, now)
		if e.inflight == 0 && (e.lim.QPS == 0 || e.tokens >= e.burst) {
			delete(sh.m, id)
		}
	}
	return len(sh.m) < n
}
