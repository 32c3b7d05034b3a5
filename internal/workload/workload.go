// Package workload names who sent a DNS query. The query path records a Key:
// the cgroup v2 id and process the eBPF datapath saw send it (when it was
// captured), and its source address. A Namer turns keys into Identities off
// that path: the cgroup's directory (a systemd unit on a VM), and, for a
// Kubernetes pod's cgroup, the pod's namespace and name and the container's
// name; a key without a cgroup is named by the pod that has its source
// address, or is unknown.
package workload

import (
	"hash/maphash"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
)

// Key is what the query path knows about a query's sender. It is a value
// without pointers to the query's buffers; the zero Key is an unknown sender.
type Key struct {
	Cgroup uint64     // cgroup v2 id recorded by the datapath; 0: the query was not attributed
	PID    uint32     // the sending process (initial PID namespace), when Cgroup is set
	Addr   netip.Addr // the query's source address, unmapped
}

// Bits of ID that no cgroup id uses (ids are inode numbers, far below 2^62).
const (
	idAddr = 1 << 63 // an address key
	idV4   = 1 << 62 // ... of an IPv4 address, in the low 32 bits
)

var addrSeed = maphash.MakeSeed()

// ID is the key counters are kept under: the cgroup id, else a number derived
// from the source address (IPv4 exactly, IPv6 hashed), else idAddr alone.
func (k Key) ID() uint64 {
	switch {
	case k.Cgroup != 0:
		return k.Cgroup
	case k.Addr.Is4():
		b := k.Addr.As4()
		return idAddr | idV4 | uint64(b[0])<<24 | uint64(b[1])<<16 | uint64(b[2])<<8 | uint64(b[3])
	case k.Addr.IsValid():
		b := k.Addr.As16()
		return idAddr | maphash.Bytes(addrSeed, b[:])&^(idAddr|idV4)
	}
	return idAddr
}

// Identity is a named sender.
type Identity struct {
	// Workload is what people call it: "namespace/pod" for a pod, the cgroup's
	// directory (from the cgroup2 mount) for any other cgroup, "cgroup:ID" for
	// a cgroup removed before it was named, "unknown" for a query that was not
	// captured and whose address no pod has.
	Workload  string `json:"workload"`
	Namespace string `json:"namespace,omitempty"`
	Pod       string `json:"pod,omitempty"`
	Container string `json:"container,omitempty"`
	Cgroup    string `json:"cgroup,omitempty"`
	CgroupID  uint64 `json:"cgroup_id,omitempty"`
	PID       uint32 `json:"pid,omitempty"`
	// By says how the sender was found: "cgroup" (the datapath saw it send),
	// "address" (a pod has the query's source address) or "" (unknown).
	By string `json:"by,omitempty"`
}

// Unknown is the workload name of a sender nothing identifies.
const Unknown = "unknown"

// Pod is a pod as the pod index knows it.
type Pod struct {
	Namespace, Name, UID string
	// Containers maps container ids (as in a cgroup path: the runtime's id
	// without its "containerd://" prefix) to container names.
	Containers map[string]string
}

// PodIndex finds this node's pods (internal/kubesource implements it).
type PodIndex interface {
	PodByUID(uid string) (Pod, bool)
	PodByIP(ip netip.Addr) (Pod, bool)
}

// podUID finds a Pod UID in a cgroup path as kubelet names them: with the
// cgroupfs driver .../pod<uid>/<container>, with the systemd driver
// ...-pod<uid with '_' for '-'>.slice/...; a static Pod's UID is a hash of
// 32 hex digits.
var podUID = regexp.MustCompile(`pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})`)

// PodUID returns the UID of the Pod a cgroup path belongs to, or "".
func PodUID(cgroupPath string) string {
	m := podUID.FindAllStringSubmatch(cgroupPath, -1)
	if len(m) == 0 {
		return ""
	}
	return strings.ReplaceAll(m[len(m)-1][1], "_", "-")
}

// ContainerID returns the container id a cgroup path ends in, as runtimes
// name container cgroups: cri-containerd-<id>.scope, crio-<id>.scope,
// docker-<id>.scope (systemd driver) or <id> (cgroupfs driver).
func ContainerID(cgroupPath string) string {
	base := cgroupPath[strings.LastIndexByte(cgroupPath, '/')+1:]
	base = strings.TrimSuffix(base, ".scope")
	if i := strings.LastIndexByte(base, '-'); i >= 0 {
		base = base[i+1:]
	}
	return base
}

// podIdentity names a pod, and the container whose cgroup path is given.
func podIdentity(p Pod, cgroupPath string) Identity {
	id := Identity{Workload: p.Namespace + "/" + p.Name, Namespace: p.Namespace, Pod: p.Name}
	if cgroupPath != "" {
		id.Container = p.Containers[ContainerID(cgroupPath)]
	}
	return id
}

// removedName is the workload name of a cgroup removed before it was named.
func removedName(id uint64) string { return "cgroup:" + strconv.FormatUint(id, 10) }
