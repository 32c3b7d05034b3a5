package egressctl

import (
	"context"

	"github.com/meshdns/meshdns-ebpf/internal/egress"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Publisher takes tap events: (*tap.Hub) implements it.
type Publisher interface {
	Active() bool
	Publish(ev *tap.Event)
}

// ForwardEvents publishes the datapath's denied and audited connects to the
// tap until events is closed or ctx ends, each with the name the workload was
// answered for its destination but may not use (empty: no answer named it).
// Without a tap subscriber an event costs one check.
func (c *Controller) ForwardEvents(ctx context.Context, events <-chan egress.Event, tp Publisher) {
	for {
		select {
		case <-ctx.Done():
			return
		case e, ok := <-events:
			if !ok {
				return
			}
			if tp.Active() {
				ev := tapEvent(e, c.NameOf(e.Workload, e.Dst.Addr()))
				tp.Publish(&ev)
			}
		}
	}
}

// tapEvent is the tap's form of one egress decision.
func tapEvent(e egress.Event, name string) tap.Event {
	ev := tap.Event{Time: e.Time.UnixNano(), Key: workload.Key{Cgroup: e.Cgroup}, Dst: e.Dst,
		Answer: tap.Denied, TCP: e.Proto == egress.ProtoTCP}
	if e.Verdict == egress.Audited {
		ev.Answer = tap.Audited
	}
	ev.SetName(name)
	return ev
}
