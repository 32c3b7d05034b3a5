package agent

// Stopping: capture off, the resolver drains, every part is released in the
// reverse order of Start (or, after a handover, only this process's
// descriptors); and undoing a failed Start.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/handover"
	"github.com/meshdns/meshdns-ebpf/internal/nodeaddr"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// Close stops the agent. Without a successor: capture goes off first (queries go
// to their original nameserver), the resolver answers what was already sent to
// it, then everything is removed (the eBPF programs stay attached and pinned,
// inert, for the next agent, unless --persist=false). After a handover it only
// waits until this process has drained and released its descriptors. A
// handover in progress is waited for. Idempotent; safe after a failed Start.
func (a *Agent) Close() error {
	a.mu.Lock()
	running := a.handingOver
	a.mu.Unlock()
	if running != nil {
		select {
		case <-running:
		case <-time.After(handover.Timeout):
		}
	}
	a.mu.Lock()
	handoff := a.handedOff
	a.mu.Unlock()
	if !handoff {
		a.followLifecycle()
		a.mu.Lock()
		handoff = a.handedOff
		a.mu.Unlock()
	}
	a.shutdown(handoff)
	<-a.shutDone
	return a.shutErr
}

// shutdown releases everything once; see Close.
func (a *Agent) shutdown(handoff bool) {
	a.shutOnce.Do(func() {
		defer close(a.shutDone)
		var errs []error
		add := func(what string, err error) {
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", what, err))
			}
		}
		a.stopBackground(handoff, add)
		a.captureOff(handoff, add)
		if a.srv != nil {
			quiet := drainQuiet
			if handoff {
				quiet = 0 // the successor reads the shared sockets: stop at once
			}
			ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
			add("drain the resolver", a.srv.Drain(ctx, quiet))
			cancel()
		}
		a.release(handoff, add)
		a.shutErr = errors.Join(errs...)
		for _, e := range errs {
			a.log.Error("stop", "err", e)
		}
		switch {
		case handoff && a.successor != 0:
			a.log.Info("handed over and drained; waiting for SIGTERM", "successor", a.successor)
		case handoff:
			a.log.Info("gave up taking over; the running agent serves on")
		default:
			a.log.Info("stopped")
		}
	})
}

// stopBackground ends a handover connection in progress, closes the
// handover socket and stops the background loops and the liveness probe.
func (a *Agent) stopBackground(handoff bool, add func(string, error)) {
	a.mu.Lock()
	a.closing = true
	if a.hconn != nil {
		a.hconn.Close()
	}
	a.mu.Unlock()
	if a.hl != nil {
		a.hl.Close()
		if !handoff {
			_ = os.Remove(agentstate.HandoverPath(a.cfg.StateDir))
		}
	}
	close(a.stopLoops)
	a.loops.Wait()
	if a.liveClose != nil {
		add("liveness probe socket", a.liveClose())
	}
}

// captureOff switches capture off before the resolver drains: queries go
// to their original nameserver again. After a handover, the datapath,
// rules and node addresses are the successor's: they are only let go.
func (a *Agent) captureOff(handoff bool, add func(string, error)) {
	if handoff {
		for _, h := range []interface{ Handoff() }{a.dp, a.rules, a.nodes} {
			if h != nil && !isNilHandoff(h) {
				h.Handoff()
			}
		}
		return
	}
	if a.uninstall && a.dp != nil {
		a.dp.DetachOnClose()
	}
	a.log.Info("stopping: capture off, then the resolver drains")
	if a.dp != nil {
		add("capture off", a.dp.Unserve())
	}
	if a.rules != nil {
		add("remove iptables capture", a.rules.StopCapture())
	}
}

// release closes every part, in the reverse order of Start, and removes
// the state (unless a successor now owns it).
func (a *Agent) release(handoff bool, add func(string, error)) {
	a.egress.close(add)
	if a.dp != nil {
		add("eBPF datapath", a.dp.Close())
	}
	if a.rules != nil {
		add("iptables capture", a.rules.Close())
	}
	if a.fwd != nil {
		add("upstream", a.fwd.Close())
	}
	add("workload names and top talkers", a.work.Close())
	if a.store != nil {
		add("name sources", a.store.Close())
	}
	if a.nodes != nil {
		add("node address", a.nodes.Close())
	}
	add("admin server", a.admin.Close())
	add("local admin socket", a.local.Close())
	if a.local != nil && !handoff {
		add("local admin socket", removeFile(a.local.addr))
	}
	if a.st != nil && !handoff {
		add("state file", agentstate.Remove(a.cfg.StateDir))
	}
	add("lifecycle watch", a.life.Close())
	if a.gc != nil {
		a.gc.stop()
	}
	if a.uninstall && !handoff {
		add("state dir", removeStateDir(a.cfg.StateDir))
	}
	add("state lock", a.lock.Release())
}

// isNilHandoff reports whether h holds a nil pointer (an unused part).
func isNilHandoff(h interface{ Handoff() }) bool {
	switch p := h.(type) {
	case *redirect.Datapath:
		return p == nil
	case *ctzone.Rules:
		return p == nil
	case *nodeaddr.Set:
		return p == nil
	}
	return false
}

// abort undoes a failed Start. Taking over from a running agent, it leaves that
// agent's state alone (the datapath's pins, rules, addresses it adopted) and
// closes only its own descriptors: the predecessor notices and serves on.
func (a *Agent) abort() {
	if in := a.inherit; in != nil {
		if a.dp != nil {
			a.dp.Handoff()
		}
		if a.rules != nil {
			a.rules.Handoff()
		}
		if a.nodes != nil {
			_ = a.nodes.Abandon()
			a.nodes = nil
		}
		a.st = nil // the predecessor's state file stays
		in.CloseUnused()
		in.Close()
		a.mu.Lock()
		a.handedOff = true // nothing of the node's state is ours
		a.mu.Unlock()
	} else if a.dp != nil {
		a.dp.Discard() // leave nothing attached that was not before
	}
	a.shutdown(a.inherit != nil)
	<-a.shutDone
}
