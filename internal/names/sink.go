package names

// The sources' side of the store: the Sink each source writes its objects
// and clients through, and the accounting of large changes it applies in
// steps.

import (
	"fmt"
	"net/netip"
	"runtime"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// Sink is how a source changes what it contributes. It is safe for
// concurrent use.
type Sink interface {
	// Set replaces the hosts of one object (a Service with its endpoint
	// names, a ServiceEntry, a file entry); no hosts removes it.
	Set(key string, hosts []nametable.Host) error
	// SetClients records the IPs of one client (a Pod of this node) and
	// its namespace; no IPs removes it.
	SetClients(key string, ips []netip.Addr, namespace string) error
	// Load replaces everything the source contributes.
	Load(hosts map[string]nametable.Host, clients map[netip.Addr]string) error
	// Apply makes a batch of changes (nametable.Change) one table change:
	// it is checked whole first, and on an error nothing changes. A large
	// batch is applied in steps, the store's lock released between them,
	// and no table is published until its last step. The store takes the
	// change's hosts.
	Apply(c *nametable.Change) error
	// Audit compares expected, the number of objects the source's origin
	// holds that should have hosts (its own count of its final state),
	// with the number of objects the store holds for it. A mismatch is
	// counted, logged and returned; the source then delivers its state
	// again and audits once more before it calls Synced, so a table that
	// lost or kept an object is never the one that makes the store ready.
	Audit(expected int) error
	// Synced marks the first complete state as delivered.
	Synced()
	// Failed records that the source cannot reach its origin (nil: it can
	// again). Its last state keeps serving.
	Failed(err error)
}

// beginLarge tells Config.LargeChange that a change of n keys begins, when
// it replaces at least a quarter of the table's hosts. s.mu is held.
func (s *Store) beginLarge(n int) bool {
	cur := s.cur.Load()
	if s.cfg.LargeChange == nil || cur == nil || cur.Len() == 0 || 4*n < cur.Len() {
		return false
	}
	s.large++
	s.cfg.LargeChange(true)
	return true
}

// dropLarge ends a large change that was not applied (its source was
// removed meanwhile). s.mu is held.
func (s *Store) dropLarge() {
	if s.large--; s.large == 0 {
		s.cfg.LargeChange(false)
	}
}

// sink is one source's handle on the store.
type sink struct {
	s    *Store
	st   *sourceState
	name string
}

func (k *sink) changed(err error) error {
	if err != nil {
		k.st.errors++
		k.st.lastErr = err.Error()
		k.s.log.Warn("name source delivered a bad object", "source", k.name, "err", err)
		return err
	}
	k.st.last = time.Now()
	k.s.poke()
	return nil
}

func (k *sink) live() bool { return !k.st.removed }

func (k *sink) Set(key string, hosts []nametable.Host) error {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if !k.live() {
		return nil
	}
	return k.changed(k.s.b.Set(k.name, key, hosts))
}

func (k *sink) SetClients(key string, ips []netip.Addr, ns string) error {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if !k.live() {
		return nil
	}
	had := k.s.b.HasClient(k.name, key)
	err := k.s.b.SetClients(k.name, key, ips, ns)
	if err == nil {
		switch has := len(ips) > 0; {
		case has && !had:
			k.st.clients++
		case !has && had:
			k.st.clients--
		}
	}
	return k.changed(err)
}

func (k *sink) Load(hosts map[string]nametable.Host, clients map[netip.Addr]string) error {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if !k.live() {
		return nil
	}
	err := k.s.b.Load(k.name, hosts, clients)
	if err == nil {
		k.st.clients = len(clients)
		k.s.replaced += len(hosts)
	}
	return k.changed(err)
}

// ApplyStep is how many keys of a change Sink.Apply applies under one hold
// of the store's lock (about a millisecond's work): other sources' updates
// and status reads wait at most that long for a large reload.
const ApplyStep = 512

func (k *sink) Apply(c *nametable.Change) error {
	s := k.s
	s.mu.Lock()
	if !k.live() {
		s.mu.Unlock()
		return nil
	}
	if err := s.b.Check(k.name, c); err != nil {
		err = k.changed(err)
		s.mu.Unlock()
		return err
	}
	large := s.beginLarge(len(c.Set) + len(c.Gone))
	s.applying++
	for {
		done := !k.live() || s.b.ApplySome(k.name, c, ApplyStep)
		if done {
			break
		}
		s.mu.Unlock()
		if s.betweenSteps != nil {
			s.betweenSteps()
		}
		runtime.Gosched()
		s.mu.Lock()
	}
	s.applying--
	defer s.mu.Unlock()
	if !k.live() {
		if large {
			s.dropLarge()
		}
		return nil
	}
	s.replaced += len(c.Set) + len(c.Gone)
	if c.ClientsChanged {
		k.st.clients = len(c.Clients)
	}
	return k.changed(nil)
}

func (k *sink) Audit(expected int) error {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if !k.live() {
		return nil
	}
	have := k.s.b.Objects(k.name)
	if have == expected {
		return nil
	}
	k.st.audits++
	err := fmt.Errorf("name source %s: the store holds %d objects, its origin %d", k.name, have, expected)
	k.s.log.Warn("name source audit found a mismatch: delivering its state again", "source", k.name, "have", have, "want", expected)
	return err
}

func (k *sink) Synced() {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if k.st.synced || !k.live() {
		return
	}
	k.st.synced = true
	k.s.log.Info("name source synced", "source", k.name, "objects", k.s.b.Objects(k.name))
	if k.s.ready {
		k.s.poke() // an optional source's first state may be held back until now
	} else {
		k.s.checkReadyLocked() // pokes when it makes the store ready
	}
}

func (k *sink) Failed(err error) {
	k.s.mu.Lock()
	defer k.s.mu.Unlock()
	if err == nil {
		if !k.st.failing.IsZero() {
			k.s.log.Info("name source recovered", "source", k.name, "after", time.Since(k.st.failing).Round(time.Millisecond))
		}
		k.st.failing = time.Time{}
		return
	}
	k.st.errors++
	k.st.lastErr = err.Error()
	if k.st.failing.IsZero() {
		k.st.failing = time.Now()
		if k.st.synced {
			k.s.log.Warn("name source failing, serving its last state", "source", k.name, "err", err)
		} else {
			k.s.log.Warn("name source failing before its first sync", "source", k.name, "optional", k.st.opts.Optional, "err", err)
		}
		k.s.checkReadyLocked()
	}
}
