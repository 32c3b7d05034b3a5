package redirect

import "github.com/cilium/ebpf"

// hook describes one program of bpf/redirect.c. The order of hooks is the order of
// the C enum hook (the index of a hook's row in the stats map); a test compares
// both with the C source.
type hook struct {
	name       string          // program name, pin name and HOOK column
	section    string          // ELF section
	attach     ebpf.AttachType // attach type
	attachName string          // kernel name of the attach type, for messages
}

var hooks = []hook{
	{"connect4", "cgroup/connect4", ebpf.AttachCGroupInet4Connect, "BPF_CGROUP_INET4_CONNECT"},
	{"connect6", "cgroup/connect6", ebpf.AttachCGroupInet6Connect, "BPF_CGROUP_INET6_CONNECT"},
	{"sendmsg4", "cgroup/sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, "BPF_CGROUP_UDP4_SENDMSG"},
	{"sendmsg6", "cgroup/sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, "BPF_CGROUP_UDP6_SENDMSG"},
	{"recvmsg4", "cgroup/recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, "BPF_CGROUP_UDP4_RECVMSG"},
	{"recvmsg6", "cgroup/recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, "BPF_CGROUP_UDP6_RECVMSG"},
	{"getpeername4", "cgroup/getpeername4", ebpf.AttachCgroupInet4GetPeername, "BPF_CGROUP_INET4_GETPEERNAME"},
	{"getpeername6", "cgroup/getpeername6", ebpf.AttachCgroupInet6GetPeername, "BPF_CGROUP_INET6_GETPEERNAME"},
	{"sock_release", "cgroup/sock_release", ebpf.AttachCgroupInetSockRelease, "BPF_CGROUP_INET_SOCK_RELEASE"},
}

// counterNames are the per-hook counters in the order of the C enum counter.
var counterNames = []string{
	"redirected_udp",
	"redirected_tcp",
	"reply_rewritten",
	"skip_proxy",
	"skip_resolver",
	"skip_not_ready",
	"skip_not_captured",
	"skip_loopback",
	"skip_other_netns",
	"map_miss",
	"map_error",
}

// cgroupCounterNames are the per-cgroup counters in the order of the C enum
// cgroup_counter.
var cgroupCounterNames = []string{
	"redirected_udp",
	"redirected_tcp",
	"reply_rewritten",
	"skipped",
}

// Flags of meshdns_config.flags, as in bpf/redirect.c.
const (
	flagTarget4         = 1 << 0
	flagTarget6         = 1 << 1
	flagCaptureAll      = 1 << 2
	flagCaptureLoopback = 1 << 3
	flagTarget4Loopback = 1 << 4
	flagTarget6Loopback = 1 << 5
)

// maxNameservers is MAX_NAMESERVERS in bpf/redirect.c (the nameservers map size
// and the bound of sock_release's loop over slots).
const maxNameservers = 32

// maxProxyUIDs is the size of the proxy_uids map.
const maxProxyUIDs = 64

// heartbeatTimeout is HEARTBEAT_TIMEOUT_NS: the programs stop redirecting when the
// agent's heartbeat is older.
const heartbeatTimeoutNS = 600_000_000

// Pin layout under Config.PinDir.
const (
	linksDir = "links"
	mapsDir  = "maps"
)
