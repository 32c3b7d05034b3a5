// Package agentstate is what a running agent publishes about itself on the
// node, and all that the CLI (internal/agentclient) and a successor agent
// read of it: the state directory's paths (state file, lock, handover and
// local admin sockets), the state file, the state lock, the default pin
// directory and the header naming the agent that answered an admin request.
// It links nothing of the agent itself.
package agentstate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// DefaultStateDir holds the running agent's lock, state file and handover socket,
// read by `status` and `cleanup`.
const DefaultStateDir = "/run/meshdns"

// DefaultBPFFS is where the agent pins its links and maps, and where the CLI reads them.
const DefaultBPFFS = "/sys/fs/bpf/meshdns"

// The capture modes a state file records (State.Mode).
const (
	ModeEBPF     = "ebpf"
	ModeIptables = "iptables"
	ModeOff      = "off" // resolver only, no capture
)

// AgentHeader names the agent that answered an admin request: its pid and
// the inode of its pid namespace (a container's own), so a probe run in the
// agent's container can tell its agent from a predecessor that shares the
// node's listeners with it until the handover.
const AgentHeader = "Meshdns-Agent"

// State is what a running agent tells the CLI (and its successor) about itself.
type State struct {
	PID         int        `json:"pid"`         // informational: the lock, not the pid, says whether it runs
	Mode        string     `json:"mode"`        // ebpf, iptables or off
	ModeReason  string     `json:"mode_reason"` // why auto picked this mode
	Listen      []string   `json:"listen"`      // resolver addresses (UDP and TCP)
	SlotPorts   []uint16   `json:"slot_ports"`  // ports per captured nameserver slot (ebpf)
	Nameservers []string   `json:"nameservers"` // captured destinations
	CaptureAll  bool       `json:"capture_all"`
	Upstreams   []string   `json:"upstreams"`
	Cgroup      string     `json:"cgroup,omitempty"`
	BPFFS       string     `json:"bpffs,omitempty"`
	BPFFSMount  string     `json:"bpffs_mount,omitempty"` // the mount holding BPFFS: point (fstype, propagation)
	Backend     string     `json:"iptables_backend,omitempty"`
	Admin       string     `json:"admin,omitempty"`
	Local       string     `json:"local,omitempty"` // the local admin socket (every endpoint, debug included)
	NodeAddrs   []NodeAddr `json:"node_addrs,omitempty"`
	Persist     bool       `json:"persist"`
	Started     time.Time  `json:"started"`
	Netns       uint64     `json:"netns"`                 // inode of the agent's network namespace
	Predecessor int        `json:"predecessor,omitempty"` // pid of the agent it took over from
}

// NodeAddr records a resolver address the agent added to this network namespace, so
// stop and `cleanup` remove exactly that and nothing else.
type NodeAddr struct {
	Link        string `json:"link"`         // link the address was added to
	Addr        string `json:"addr"`         // CIDR, e.g. 169.254.20.53/32
	CreatedLink bool   `json:"created_link"` // the agent created Link (and deletes it)
}

// Netns is the inode of this process's network namespace.
func Netns() uint64 { return nsInode("net") }

// Pidns is the inode of this process's pid namespace (its container's), as
// AgentHeader carries it.
func Pidns() uint64 { return nsInode("pid") }

// nsInode is the inode of this process's namespace of kind ("net", "pid").
func nsInode(kind string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Stat("/proc/self/ns/"+kind, &st); err != nil {
		return 0
	}
	return st.Ino
}

// StatePath is the state file in dir.
func StatePath(dir string) string { return filepath.Join(dir, "agent.json") }

// LockPath is the state lock's file in dir.
func LockPath(dir string) string { return filepath.Join(dir, "agent.lock") }

// HandoverPath is the running agent's handover socket in dir.
func HandoverPath(dir string) string { return filepath.Join(dir, "handover.sock") }

// LocalPath is the agent's local admin socket in its state directory: every
// admin endpoint, the debug ones included (docs/kubernetes.md).
func LocalPath(dir string) string { return filepath.Join(dir, "admin.sock") }

// PinDir is where the CLI looks for the agent's pins: flag (--bpffs) when
// given, else the directory the agent's state file in stateDir records, else
// DefaultBPFFS.
func PinDir(stateDir, flag string) string {
	if flag != "" {
		return flag
	}
	if st, err := Read(stateDir); err == nil && st.BPFFS != "" {
		return st.BPFFS
	}
	return DefaultBPFFS
}

// Write replaces the state file in dir (creating dir) with st, atomically:
// a reader sees the old file or the new one.
func Write(dir string, st *State) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create state dir %s: %w", dir, err)
	}
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	tmp := StatePath(dir) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	if err := os.Rename(tmp, StatePath(dir)); err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	return nil
}

// Read reads the state file an agent left in dir. os.ErrNotExist means no agent
// has run there (or it stopped cleanly).
func Read(dir string) (*State, error) {
	b, err := os.ReadFile(StatePath(dir))
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("parse %s: %w", StatePath(dir), err)
	}
	return &st, nil
}

// Remove removes the state file of dir; a missing file is no error.
func Remove(dir string) error {
	err := os.Remove(StatePath(dir))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove state file: %w", err)
	}
	return nil
}
