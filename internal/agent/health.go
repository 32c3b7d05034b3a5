package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/resolver"
)

// Readiness and liveness: what /readyz and /healthz report, and the capture
// that follows the resolver's readiness (its sockets registered with the
// datapath while it is ready).

// Ready is the agent's readiness (/readyz): the name sources' and the
// resolver's, once it serves the node: not while it is still taking over,
// nor once it handed over.
func (a *Agent) Ready() error {
	a.mu.Lock()
	off, succ, pred := a.handedOff, a.successor, a.takingOver
	a.mu.Unlock()
	if off {
		return fmt.Errorf("handed over to pid %d", succ)
	}
	if pred != 0 {
		return fmt.Errorf("taking over from pid %d", pred)
	}
	if a.srv == nil || a.store == nil {
		return errors.New("resolver not started")
	}
	if err := a.store.Ready(); err != nil {
		return err
	}
	return a.srv.Ready()
}

// Live is the agent's liveness (/healthz): its resolver is not wedged. An
// agent that handed over (it waits for its SIGTERM) or is stopping is live.
func (a *Agent) Live() error {
	a.mu.Lock()
	done := a.handedOff || a.closing
	a.mu.Unlock()
	if done || a.live == nil {
		return nil
	}
	return a.live.check(time.Now())
}

// watchLiveness sets up the resolver's liveness monitor (liveness.go), which
// probes the resolver's first address.
func (a *Agent) watchLiveness() error {
	addrs := a.srv.Addrs()
	if len(addrs) == 0 {
		return errors.New("liveness: the resolver has no address")
	}
	send, closeProbe, err := resolverProbe(addrs[0])
	if err != nil {
		return err
	}
	a.liveClose = closeProbe
	a.live = newLiveness(a.srv.Progress, send, time.Now())
	return nil
}

func (a *Agent) livenessLoop() {
	defer a.loops.Done()
	t := time.NewTicker(livenessInterval)
	defer t.Stop()
	for {
		select {
		case <-a.stopLoops:
			return
		case now := <-t.C:
			a.live.look(now)
		}
	}
}

// waitReady polls ready until it reports nil, ctx is done or d passed.
func waitReady(ctx context.Context, ready func() error, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		err := ready()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// followReadiness registers the resolver's sockets with the datapath while the
// resolver is ready and unregisters them while it is not.
func (a *Agent) followReadiness() error {
	if a.dp == nil {
		return nil
	}
	notReady := a.store.Ready()
	if notReady == nil {
		notReady = a.srv.Ready()
	}
	ready := notReady == nil
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closing || a.handedOff || ready == a.serving {
		return nil
	}
	if !ready {
		if err := a.dp.Unserve(); err != nil {
			return err
		}
		a.serving = false
		a.log.Warn("resolver not ready: capture off", "reason", notReady)
		return nil
	}
	if err := a.serveSockets(); err != nil {
		return err
	}
	a.serving = true
	a.log.Info("resolver ready: capture on")
	return nil
}

// serveSockets registers one socket per listen address and protocol.
func (a *Agent) serveSockets() error {
	files, err := a.srv.Files()
	if err != nil {
		return err
	}
	defer closeListenerFiles(files)
	var socks []redirect.Socket
	for _, l := range files {
		ap, err := netip.ParseAddrPort(l.Addr)
		if err != nil {
			return fmt.Errorf("resolver listen address %q: %w", l.Addr, err)
		}
		socks = append(socks, redirect.Socket{Addr: ap, Conn: l.UDP[0]}, redirect.Socket{Addr: ap, TCP: true, Conn: l.TCP})
	}
	return a.dp.Serve(socks)
}

func closeListenerFiles(files []resolver.InheritedListener) {
	for _, l := range files {
		for _, f := range l.UDP {
			f.Close()
		}
		if l.TCP != nil {
			l.TCP.Close()
		}
	}
}

func (a *Agent) readinessLoop() {
	defer a.loops.Done()
	t := time.NewTicker(readinessInterval)
	defer t.Stop()
	for {
		select {
		case <-a.stopLoops:
			return
		case <-t.C:
		}
		if err := a.followReadiness(); err != nil {
			a.log.Error("capture readiness", "err", err)
		}
	}
}
