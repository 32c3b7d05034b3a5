// Package redirect is meshdns-ebpf's eBPF datapath: it loads the cgroup sock_addr
// programs of bpf/redirect.c (compiled by bpf2go, committed), writes their
// configuration into maps, attaches them to a cgroup v2 directory with bpf_links
// (or adopts the links a previous agent left pinned, replacing their programs
// atomically), registers the resolver's listening sockets that switch capture on,
// feeds the resolver's progress to the programs, and reads their counters back
// for the CLI and for metrics.
//
// The programs redirect port-53 traffic to captured nameservers to the resolver
// (nameserver i goes to the resolver's port base+i, see [SlotPorts]) and restore
// the original nameserver as reply source and peer. They redirect only to a slot
// whose resolver socket is registered ([Datapath.Serve]); the kernel drops a
// socket from that set when it closes, so a dead resolver is bypassed at once. A
// resolver that stops dequeuing is bypassed after [DefaultStallAfter]
// (progress, see [Datapath.Dequeued]).
//
// Lifecycle: [New] validates, [Datapath.Start] acquires, [Datapath.Close]
// releases. A clean Close leaves the programs attached and pinned (inert, since
// no resolver socket is registered) for the next agent to adopt, unless
// Config.Detach.
package redirect

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf/link"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// Datapath is the loaded, configured and attached set of programs.
type Datapath struct {
	log    *slog.Logger
	set    *settings
	pinDir string

	mu       sync.Mutex
	started  bool
	closed   bool
	handoff  bool
	discard  bool
	netns    uint64  // cookie of Start's network namespace
	loaded   *loaded // what Load (or Start) loaded
	objs     redirectObjects
	links    []attached
	progress *progress
	clock    *watchClock            // nil where the kernel has no BPF timers
	dequeued atomic.Pointer[uint64] // progress.dequeued while mapped
	flows    *Flows                 // the flows map, memory-mapped
	served   []uint32               // resolver_socks keys we registered
	ownPins  []string               // map pins Start made (not reused)
	// madePinDir: the pin directory did not exist before Start.
	madePinDir bool
	order      Ordering                          // how ours are placed among other programs (order.go)
	backends   map[redirectNsKey]redirectBackend // SetBackends' (backends.go)
	cgroups    *cgroup2.Namer
	probe      *net.UDPConn // the watchdog's, opened in Start's network namespace
	stopWD     context.CancelFunc
	wdDone     chan struct{}
}

type attached struct {
	hook    hook
	link    link.Link
	id      link.ID
	pin     string
	adopted bool // the link was pinned by a previous agent; we replaced its program
}

// ProgramInfo describes one attached program.
type ProgramInfo struct {
	Hook      string `json:"hook"`
	ProgramID uint32 `json:"program_id"`
	LinkID    uint32 `json:"link_id"`
	Cgroup    string `json:"cgroup"`
}

// New validates cfg. It touches nothing in the kernel.
func New(cfg Config) (*Datapath, error) {
	set, err := validate(cfg)
	if err != nil {
		return nil, fmt.Errorf("invalid datapath config: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	order := Ordering{Supported: true}
	if cfg.Unordered || os.Getenv(UnorderedEnv) == "1" {
		order = Ordering{Reason: "ordered attach switched off"}
	}
	return &Datapath{log: log, set: set, pinDir: cfg.PinDir, order: order, cgroups: cgroup2.NewNamer()}, nil
}

// Programs lists the attached programs.
func (d *Datapath) Programs() []ProgramInfo {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.programsLocked()
}

// programsLocked is Programs with d.mu held.
func (d *Datapath) programsLocked() []ProgramInfo {
	out := make([]ProgramInfo, 0, len(d.links))
	progs := d.programsByName()
	for _, a := range d.links {
		pi := ProgramInfo{Hook: a.hook.name, LinkID: uint32(a.id), Cgroup: d.set.cfg.Cgroup}
		if p := progs[a.hook.name]; p != nil {
			if info, err := p.Info(); err == nil {
				if id, ok := info.ID(); ok {
					pi.ProgramID = uint32(id)
				}
			}
		}
		out = append(out, pi)
	}
	return out
}
