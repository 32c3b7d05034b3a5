package agent

// The agent's side of a handover (the protocol is internal/handover): taking
// over from a running agent at Start, and handing over to a successor
// while running; and what a crashed agent left.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/handover"
	"github.com/meshdns/meshdns-ebpf/internal/nodeaddr"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// acquirePrevious takes the state lock, or the running agent's descriptors,
// and returns the previous agent's state (nil: none). After a crash it
// removes what the crashed agent left that this one does not adopt.
func (a *Agent) acquirePrevious(ctx context.Context) (*agentstate.State, error) {
	if err := a.acquire(ctx); err != nil {
		return nil, err
	}
	if a.inherit != nil {
		return a.inherit.State, nil
	}
	prev, err := agentstate.Read(a.cfg.StateDir)
	switch {
	case err == nil:
		// A clean stop removes the state file: its owner crashed.
		a.takeOverLeftovers(prev)
	case !errors.Is(err, os.ErrNotExist):
		a.log.Warn("unreadable state file of a previous agent; ignoring it", "err", err)
		prev = nil
	default:
		prev = nil
	}
	if a.plan.mode != ModeEBPF {
		// An eBPF agent stopped here earlier left its programs attached
		// (inert) for a successor in eBPF mode: this one is not.
		if removed, err := redirect.Cleanup(a.cfg.BPFFS); len(removed) > 0 || err != nil {
			a.log.Info("removed the eBPF programs an earlier agent left", "pin_dir", a.cfg.BPFFS, "removed", len(removed), "err", err)
		}
	}
	return prev, nil
}

// acquire takes the state lock, or, while another agent holds it, takes over
// from that agent: its lock, admin listener and resolver sockets.
func (a *Agent) acquire(ctx context.Context) error {
	dir := a.cfg.StateDir
	deadline := handoverDeadline(ctx)
	var last error
	for ready := false; ; {
		l, err := agentstate.TryLock(dir)
		if err == nil {
			a.lock = l
			return nil
		}
		if !errors.Is(err, agentstate.ErrLocked) {
			return err
		}
		if !ready {
			if err := a.readyToTakeOver(ctx); err != nil {
				return err
			}
			ready, deadline = true, handoverDeadline(ctx)
		}
		hctx, cancel := context.WithDeadline(ctx, deadline)
		in, err := handover.Request(hctx, dir)
		cancel()
		if err == nil {
			if err := a.compatible(in.State); err != nil {
				in.CloseUnused()
				in.Lock.Release()
				in.Close()
				return err
			}
			a.lock, a.inherit = in.Lock, in
			a.setTakingOver(in.From)
			a.log.Info("taking over from the running agent", "pid", in.From)
			return nil
		}
		if !errors.Is(err, handover.ErrRetry) {
			return err
		}
		last = err
		if time.Now().After(deadline) {
			return fmt.Errorf("another meshdns-ebpf agent holds %s and did not hand over within %v (last: %v); stop it first",
				agentstate.LockPath(dir), handover.Timeout, last)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// handoverDeadline is when asking for a handover gives up.
func handoverDeadline(ctx context.Context) time.Time {
	deadline := time.Now().Add(handover.Timeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	return deadline
}

// readyToTakeOver waits until the name sources are ready: our resolver
// reads the running agent's sockets as soon as it has them, so we ask for
// them only once we can answer as well as it does, and quickly (should it
// die once it has sent them, no one reads them until we do).
func (a *Agent) readyToTakeOver(ctx context.Context) error {
	if a.store == nil {
		return nil
	}
	if err := waitReady(ctx, a.store.Ready, handover.Timeout); err != nil {
		return fmt.Errorf("taking over: the name sources are not ready: %w", err)
	}
	return nil
}

// compatible says whether we can take over from an agent in state st.
func (a *Agent) compatible(st *agentstate.State) error {
	switch {
	case st.Mode != a.plan.mode:
		return fmt.Errorf("the running agent (pid %d) captures in %s mode and this one would in %s mode: stop it first", st.PID, st.Mode, a.plan.mode)
	case a.plan.mode == ModeEBPF && (st.BPFFS != a.cfg.BPFFS || st.Cgroup != a.plan.cgroup):
		return fmt.Errorf("the running agent (pid %d) attaches to %s with pins in %s, this one to %s with pins in %s: stop it first",
			st.PID, st.Cgroup, st.BPFFS, a.plan.cgroup, a.cfg.BPFFS)
	case st.Netns != agentstate.Netns():
		return fmt.Errorf("the running agent (pid %d) runs in another network namespace: stop it first", st.PID)
	}
	return nil
}

// takeOverLeftovers removes what a crashed agent left that this one does not
// adopt: another mode's capture, another pin directory's programs. (Pinned
// links and node addresses we use are adopted.)
func (a *Agent) takeOverLeftovers(prev *agentstate.State) {
	var removed []string
	var errs []error
	if prev.Mode == ModeIptables && a.plan.mode != ModeIptables {
		r, err := ctzone.Cleanup(prev.Backend)
		removed, errs = append(removed, r...), append(errs, err)
	}
	if prev.Mode == ModeEBPF && prev.BPFFS != "" && (a.plan.mode != ModeEBPF || prev.BPFFS != a.cfg.BPFFS) {
		r, err := redirect.Cleanup(prev.BPFFS)
		removed, errs = append(removed, r...), append(errs, err)
	}
	if prev.Netns == agentstate.Netns() {
		removed = append(removed, a.removeUnwantedAddrs(prev)...)
	}
	if err := errors.Join(errs...); err != nil {
		a.log.Warn("could not remove all a previous agent left", "pid", prev.PID, "err", err)
	}
	a.log.Info("a previous agent did not stop cleanly; taking over what it left", "pid", prev.PID, "removed", removed)
}

// removeUnwantedAddrs removes the addresses prev added that we do not listen on.
func (a *Agent) removeUnwantedAddrs(prev *agentstate.State) []string {
	var drop []agentstate.NodeAddr
	for _, na := range prev.NodeAddrs {
		if na.Addr == "" {
			continue
		}
		p, err := netip.ParsePrefix(na.Addr)
		if err != nil || slices.ContainsFunc(a.cfg.Listen, func(l netip.AddrPort) bool { return l.Addr() == p.Addr() }) {
			continue
		}
		drop = append(drop, na)
	}
	if len(drop) == 0 {
		return nil
	}
	if err := nodeaddr.Remove(drop, a.log); err != nil {
		a.log.Warn("remove a previous agent's address", "err", err)
	}
	var out []string
	for _, d := range drop {
		out = append(out, "address "+d.Addr+" on "+d.Link)
	}
	return out
}

// handoverLoop serves successors' requests, one at a time.
func (a *Agent) handoverLoop() {
	defer a.loops.Done()
	for {
		c, err := a.hl.AcceptUnix()
		if err != nil {
			return
		}
		a.handleHandover(c)
	}
}

// handleHandover serves one successor's request: its hello, then a refusal
// or the offer; once it serves, this agent drains and stops; if it fails,
// this agent puts its own state back and serves on.
func (a *Agent) handleHandover(c *net.UnixConn) {
	defer c.Close()
	a.mu.Lock()
	a.hconn = c // shutdown closes it
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.hconn = nil
		a.mu.Unlock()
	}()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	pid, err := handover.ReadHello(c)
	if err != nil {
		return
	}
	done, refuse := a.beginHandover()
	if refuse != "" {
		_ = handover.Refuse(c, refuse)
		return
	}
	defer func() {
		a.mu.Lock()
		a.handingOver = nil
		a.mu.Unlock()
		close(done)
	}()
	a.log.Info("a successor asks to take over", "pid", pid)
	o, release, err := a.makeOffer()
	if err != nil {
		_ = handover.Refuse(c, err.Error())
		return
	}
	defer release()
	_ = c.SetDeadline(time.Now().Add(handover.Timeout))
	succ, err := handover.SendOffer(c, o)
	if err != nil {
		a.log.Warn("handover failed; serving on", "successor", pid, "err", err)
		a.reassert()
		return
	}
	a.mu.Lock()
	a.handedOff, a.successor = true, succ
	a.mu.Unlock()
	a.log.Info("handed over to the successor; draining", "pid", succ)
	go a.shutdown(true)
}

// beginHandover marks a handover as running (Close waits for done to be
// closed), or says why this agent refuses one.
func (a *Agent) beginHandover() (done chan struct{}, refuse string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.closing:
		return nil, "stopping"
	case a.handedOff:
		return nil, fmt.Sprintf("already handed over to pid %d", a.successor)
	case a.store.Ready() != nil || a.srv.Ready() != nil:
		return nil, "not ready"
	}
	done = make(chan struct{})
	a.handingOver = done
	return done, ""
}

// makeOffer gathers what a successor takes: a copy of the state, the lock,
// the admin listeners and the resolver's sockets. release closes this
// process's duplicates of them once sent.
func (a *Agent) makeOffer() (o handover.Offer, release func(), err error) {
	o = handover.Offer{Lock: a.lock.File(), DieAfterSend: a.cfg.handoverFault == "predecessor"}
	stCopy := *a.st
	o.State = &stCopy
	var opened []*os.File
	release = func() {
		for _, f := range opened {
			f.Close()
		}
		closeListenerFiles(o.Listeners)
	}
	for _, l := range []struct {
		srv  *adminServer
		file **os.File
	}{{a.admin, &o.Admin}, {a.local, &o.Local}} {
		if l.srv == nil {
			continue
		}
		if *l.file, err = l.srv.File(); err != nil {
			a.log.Error("handover: admin listener", "addr", l.srv.addr, "err", err)
			release()
			return handover.Offer{}, nil, err
		}
		opened = append(opened, *l.file)
	}
	if o.Listeners, err = a.srv.Files(); err != nil {
		a.log.Error("handover: resolver sockets", "err", err)
		release()
		return handover.Offer{}, nil, err
	}
	return o, release, nil
}

// reassert puts our programs, configuration, sockets and state back after a
// successor failed to take over (it may have replaced some of them).
func (a *Agent) reassert() {
	if a.dp != nil {
		if err := a.dp.Reassert(); err != nil {
			a.log.Error("restore the datapath after a failed handover", "err", err)
		}
		a.mu.Lock()
		if a.serving {
			if err := a.serveSockets(); err != nil {
				a.log.Error("register the resolver sockets again after a failed handover", "err", err)
			}
		}
		a.mu.Unlock()
	}
	if err := a.save(); err != nil {
		a.log.Error("restore the state file after a failed handover", "err", err)
	}
}

// serveSuccessors ends a takeover (the predecessor learns that we serve)
// and opens the handover socket for this agent's own successor.
func (a *Agent) serveSuccessors(prev *agentstate.State) (err error) {
	if a.inherit != nil {
		a.finishTakeover(prev)
		return nil
	}
	if a.plan.mode == ModeOff {
		return nil
	}
	if a.hl, err = handover.Listen(a.cfg.StateDir); err != nil {
		return err
	}
	return a.save()
}

// finishTakeover tells the predecessor that we serve. Nothing of the node's
// state is touched before: if we die before, it serves on as it was.
func (a *Agent) finishTakeover(prev *agentstate.State) {
	in, log := a.inherit, a.log
	in.CloseUnused()
	if a.cfg.handoverFault == "successor" {
		log.Error("x-handover-fault: the successor dies before it serves")
		os.Exit(3)
	}
	if err := in.Serving(); err != nil {
		log.Warn("could not tell the previous agent that we serve; it may have died", "pid", in.From, "err", err)
	}
	if prev != nil {
		a.removeUnwantedAddrs(prev)
	}
	log.Info("took over from the previous agent", "pid", in.From)
	a.inherit = nil
	a.setTakingOver(0)
	var err error
	if a.hl, err = handover.Listen(a.cfg.StateDir); err != nil {
		log.Error("no handover socket: a successor will not be able to take over", "err", err)
	}
	if err := a.save(); err != nil {
		log.Error("write state", "err", err)
	}
}
