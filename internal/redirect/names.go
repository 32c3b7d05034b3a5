package redirect

import (
	"fmt"
	"github.com/meshdns/meshdns-ebpf/internal/captureplan"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
)

// hook describes one program of bpf/redirect.c. Its row in the stats map is its
// enum hook value.
type hook struct {
	name       string          // program name, pin name and HOOK column
	section    string          // ELF section
	attach     ebpf.AttachType // attach type
	attachName string          // kernel name of the attach type, for messages
	row        redirectHook    // enum hook
}

var hooks = []hook{
	{"connect4", "cgroup/connect4", ebpf.AttachCGroupInet4Connect, "BPF_CGROUP_INET4_CONNECT", redirectHookHOOK_CONNECT4},
	{"connect6", "cgroup/connect6", ebpf.AttachCGroupInet6Connect, "BPF_CGROUP_INET6_CONNECT", redirectHookHOOK_CONNECT6},
	{"sendmsg4", "cgroup/sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, "BPF_CGROUP_UDP4_SENDMSG", redirectHookHOOK_SENDMSG4},
	{"sendmsg6", "cgroup/sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, "BPF_CGROUP_UDP6_SENDMSG", redirectHookHOOK_SENDMSG6},
	{"recvmsg4", "cgroup/recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, "BPF_CGROUP_UDP4_RECVMSG", redirectHookHOOK_RECVMSG4},
	{"recvmsg6", "cgroup/recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, "BPF_CGROUP_UDP6_RECVMSG", redirectHookHOOK_RECVMSG6},
	{"getpeername4", "cgroup/getpeername4", ebpf.AttachCgroupInet4GetPeername, "BPF_CGROUP_INET4_GETPEERNAME", redirectHookHOOK_GETPEERNAME4},
	{"getpeername6", "cgroup/getpeername6", ebpf.AttachCgroupInet6GetPeername, "BPF_CGROUP_INET6_GETPEERNAME", redirectHookHOOK_GETPEERNAME6},
	{"attribute", "cgroup_skb/egress", ebpf.AttachCGroupInetEgress, "BPF_CGROUP_INET_EGRESS", redirectHookHOOK_EGRESS},
	{"sock_release", "cgroup/sock_release", ebpf.AttachCgroupInetSockRelease, "BPF_CGROUP_INET_SOCK_RELEASE", redirectHookHOOK_SOCK_RELEASE},
}

// Limits of bpf/redirect.c (enum meshdns_limits, exported by bpf2go).
const (
	maxNameservers = int(redirectMeshdnsLimitsMAX_NAMESERVERS)
	maxAllSlots    = int(redirectMeshdnsLimitsMAX_ALL_SLOTS)
	maxSlots       = int(redirectMeshdnsLimitsMAX_SLOTS)
	maxProxyUIDs   = int(redirectMeshdnsLimitsMAX_PROXY_UIDS)
	sockEntries    = int(redirectMeshdnsLimitsSOCK_ENTRIES)
	flowWays       = int(redirectMeshdnsLimitsFLOW_WAYS)
	flowBucketBits = int(redirectMeshdnsLimitsFLOW_BUCKET_BITS)
	flowBuckets    = int(redirectMeshdnsLimitsFLOW_BUCKETS)
)

// The capture plan reserves as many capture-all slots as the programs use:
// this fails to compile when bpf/redirect.c's MAX_ALL_SLOTS and
// captureplan.CaptureAllSlots disagree.
const _ = uint(maxAllSlots-captureplan.CaptureAllSlots) + uint(captureplan.CaptureAllSlots-maxAllSlots)

// Flags of meshdns_config.flags (enum meshdns_flags).
const (
	flagTarget4         = uint32(redirectMeshdnsFlagsFLAG_TARGET4)
	flagTarget6         = uint32(redirectMeshdnsFlagsFLAG_TARGET6)
	flagCaptureAll      = uint32(redirectMeshdnsFlagsFLAG_CAPTURE_ALL)
	flagCaptureLoopback = uint32(redirectMeshdnsFlagsFLAG_CAPTURE_LOOPBACK)
	flagTarget4Loopback = uint32(redirectMeshdnsFlagsFLAG_TARGET4LOOPBACK)
	flagTarget6Loopback = uint32(redirectMeshdnsFlagsFLAG_TARGET6LOOPBACK)
	flagAttribution     = uint32(redirectMeshdnsFlagsFLAG_ATTRIBUTION)
)

// resolverSockIndex is the resolver_socks key of a socket (enum
// resolver_sock_kind): ((family * 2) + protocol) * MAX_SLOTS + slot.
func resolverSockIndex(v6, tcp bool, slot int) uint32 {
	fam, proto := redirectResolverSockKindRESOLVER_FAMILY_V4, redirectResolverSockKindRESOLVER_PROTO_UDP
	if v6 {
		fam = redirectResolverSockKindRESOLVER_FAMILY_V6
	}
	if tcp {
		proto = redirectResolverSockKindRESOLVER_PROTO_TCP
	}
	return (uint32(fam)*2+uint32(proto))*uint32(maxSlots) + uint32(slot)
}

// DefaultStallAfter is how long the programs wait for the resolver to dequeue
// anything after a redirect before they suspect it stalled; they fail open
// when it still has not a quarter of that later. A frozen resolver is detected
// 200 ms (1.25 times this) after the first redirect it does not read, below the
// 250 ms the design allows.
const DefaultStallAfter = 160 * time.Millisecond

// Pin layout under Config.PinDir.
const (
	linksDir = "links"
	mapsDir  = "maps"
)

// counterNames and cgroupCounterNames are the columns of the stats maps, in
// enum order, named after the C enumerators (COUNTER_SKIP_PROXY -> skip_proxy):
// read from the object's BTF, so the C source is the only list.
var enumNames = sync.OnceValues(func() (map[string][]string, error) {
	spec, err := loadRedirect()
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, e := range []struct{ name, prefix string }{
		{"counter", "COUNTER_"},
		{"cgroup_counter", "CGROUP_"},
	} {
		var enum *btf.Enum
		if err := spec.Types.TypeByName(e.name, &enum); err != nil {
			return nil, fmt.Errorf("enum %s in the eBPF object: %w", e.name, err)
		}
		names := make([]string, 0, len(enum.Values))
		for i, v := range enum.Values {
			if strings.HasPrefix(v.Name, "NUM_") {
				continue
			}
			if v.Value != uint64(i) {
				return nil, fmt.Errorf("enum %s: %s = %d is not dense", e.name, v.Name, v.Value)
			}
			names = append(names, strings.ToLower(strings.TrimPrefix(v.Name, e.prefix)))
		}
		out[e.name] = names
	}
	return out, nil
})

// CounterNames are the per-hook counters, in the order of their columns.
func CounterNames() []string {
	n, err := enumNames()
	if err != nil {
		panic(err) // the embedded object is broken: no test would pass
	}
	return n["counter"]
}

// CgroupCounterNames are the per-cgroup counters, in the order of their columns.
func CgroupCounterNames() []string {
	n, err := enumNames()
	if err != nil {
		panic(err)
	}
	return n["cgroup_counter"]
}
