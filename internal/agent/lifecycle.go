package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/client-go/rest"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/handover"
	"github.com/meshdns/meshdns-ebpf/internal/kubelife"
)

// What a SIGTERM means in Kubernetes (kubelife): an uninstall removes
// everything the agent put on the node; a replacement pod starting on the node
// (kubectl delete pod) is handed the node over; anything else is a restart,
// which leaves the programs pinned for the next agent (--persist).
const (
	// verdictSettle is how long a SIGTERM waits for the watch event that
	// explains it (it may arrive first).
	verdictSettle = 2 * time.Second
	// successorWait bounds the wait for a replacement pod to take over; the
	// DaemonSet's grace period covers it and the drain.
	successorWait = handover.Timeout
)

// watchLifecycle starts watching the agent's own pod, DaemonSet and namespace
// when it runs in a pod it can name (kubelife.FindSelf). Without that watch a
// SIGTERM is a restart, as outside Kubernetes.
func (a *Agent) watchLifecycle(ctx context.Context, rc *rest.Config) {
	log := a.log.With("component", "lifecycle")
	self, err := kubelife.FindSelf(rc)
	if err != nil {
		log.Info("not watching the agent's own pod: a SIGTERM stops it for a restart", "reason", err)
		return
	}
	w, err := kubelife.New(kubelife.Config{Rest: rc, Self: self, Node: a.cfg.NodeName, Logger: log})
	if err == nil {
		err = w.Start(ctx)
	}
	if err != nil {
		log.Warn("cannot watch the agent's own pod: a SIGTERM stops it for a restart, also during an uninstall", "err", err)
		return
	}
	a.life = w
}

// followLifecycle decides, on Close without a handover, what the stop is: an
// uninstall (everything is removed), a replacement pod to hand over to (it
// waits for it to take over, up to successorWait), or a restart.
func (a *Agent) followLifecycle() {
	if a.life == nil {
		return
	}
	v := a.life.Verdict(context.Background(), verdictSettle)
	switch {
	case v.Uninstall:
		a.log.Info("uninstall: removing capture, programs, pins, the node address and the state", "reason", v.Reason)
		a.mu.Lock()
		a.uninstall = true
		a.mu.Unlock()
	case v.Successor != "":
		a.log.Info("a replacement pod is starting: serving until it takes over", "reason", v.Reason, "wait", successorWait)
		if !a.awaitHandover(successorWait) {
			a.log.Warn("the replacement pod did not take over in time: stopping", "pod", v.Successor)
		}
	default:
		a.log.Info("stopping for a restart: the programs stay pinned for the next agent", "reason", v.Reason)
	}
}

// awaitHandover waits until a successor took over (true) or d passed.
func (a *Agent) awaitHandover(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		a.mu.Lock()
		off, running := a.handedOff, a.handingOver
		a.mu.Unlock()
		if off {
			return true
		}
		if running != nil {
			select {
			case <-running:
			case <-time.After(time.Until(deadline)):
			}
			continue
		}
		time.Sleep(50 * time.Millisecond)
	}
	return false
}

// removeFile removes path; a missing file is no error.
func removeFile(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// removeStateDir removes what an uninstalled agent keeps in its state dir
// (the lock file, which it still holds), and the directory when it can
// (in a pod it is a mount point: only its content goes).
func removeStateDir(dir string) error {
	var errs []error
	if err := os.Remove(agentstate.LockPath(dir)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, err)
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) &&
		!errors.Is(err, unix.EBUSY) && !errors.Is(err, unix.ENOTEMPTY) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
