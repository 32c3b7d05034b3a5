package redirect

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Flows is the attribute program's record of who sent from which source
// address and port (the flows map, see "Attribution" in bpf/redirect.c),
// memory-mapped read-only: a lookup is a few loads from this process's memory,
// no system call and no allocation.
type Flows struct {
	mem     []byte
	buckets *[flowBuckets]redirectFlowBucket
	closed  atomic.Bool
}

// Sender is who sent a query, as the programs recorded it.
type Sender struct {
	Cgroup uint64 // cgroup v2 id of the task that connected or sent
	PID    uint32 // its process (thread group id, in the initial PID namespace)
	// Workload is the sender's egress workload (the id the agent gave the
	// selected cgroup it is in, see internal/egress); 0: none, or egress off.
	Workload uint32
}

const (
	protoTCP = 6
	protoUDP = 17
)

func mapFlows(m *ebpf.Map) (*Flows, error) {
	size := int(unsafe.Sizeof(redirectFlowBucket{})) * flowBuckets
	if int(m.ValueSize())*int(m.MaxEntries()) != size {
		return nil, fmt.Errorf("flows map is %d x %d bytes, want %d in total", m.MaxEntries(), m.ValueSize(), size)
	}
	mem, err := unix.Mmap(m.FD(), 0, size, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("memory-map the flows map: %w", err)
	}
	return &Flows{mem: mem, buckets: (*[flowBuckets]redirectFlowBucket)(unsafe.Pointer(&mem[0]))}, nil
}

func (f *Flows) close() {
	if f != nil && f.closed.CompareAndSwap(false, true) {
		_ = unix.Munmap(f.mem)
	}
}

// Flows returns the datapath's flow records (nil before Start). Lookups must
// stop before Close, which unmaps them.
func (d *Datapath) Flows() *Flows {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.flows
}

// flowBucketOf is flow_bucket of bpf/redirect.c.
func flowBucketOf(port uint16, proto uint8) uint32 {
	return ((uint32(port)<<8 | uint32(proto)) * 2654435761) >> (32 - flowBucketBits)
}

func flowMix(h, v uint64) uint64 {
	h ^= v
	h *= 0xff51afd7ed558ccd
	return h ^ (h >> 32)
}

// flowCheck is flow_check of bpf/redirect.c.
func flowCheck(e *redirectFlowEntry) uint64 {
	h := uint64(0x9e3779b97f4a7c15)
	h = flowMix(h, uint64(e.Addr[0])<<32|uint64(e.Addr[1]))
	h = flowMix(h, uint64(e.Addr[2])<<32|uint64(e.Addr[3]))
	h = flowMix(h, uint64(e.Port)<<40|uint64(e.Proto)<<32|uint64(e.Tgid))
	h = flowMix(h, e.CgroupId)
	h = flowMix(h, e.Cookie)
	h = flowMix(h, uint64(e.Workload))
	return h | 1
}

// Lookup returns who sent from src (as the resolver saw it: a datagram's or a
// connection's source address and port) to a redirected resolver socket, or
// false when the programs recorded nobody: the query was not redirected (sent
// straight to the resolver), or its entry was replaced since. A closed
// socket's entry still answers until another socket takes its place.
func (f *Flows) Lookup(src netip.AddrPort, tcp bool) (Sender, bool) {
	if f == nil || f.closed.Load() {
		return Sender{}, false
	}
	proto := uint8(protoUDP)
	if tcp {
		proto = protoTCP
	}
	a := src.Addr().Unmap().As16() // IPv4 as ::ffff:a.b.c.d, as the programs record it
	var words [4]uint32
	for i := range words {
		words[i] = binary.NativeEndian.Uint32(a[4*i:])
	}
	b := &f.buckets[flowBucketOf(src.Port(), proto)]
	for w := range b.E {
		e := &b.E[w]
		// A write in progress fails the checksum (or shows 0): the writer is a
		// few stores from done, so look again a few times.
		for range 4 {
			c := *e // one copy, then every check on the copy
			if c.Port != src.Port() || c.Proto != proto || c.Addr != words {
				break
			}
			if c.Check != 0 && c.Check == flowCheck(&c) {
				return Sender{Cgroup: c.CgroupId, PID: c.Tgid, Workload: c.Workload}, true
			}
		}
	}
	return Sender{}, false
}
