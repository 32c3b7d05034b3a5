package agent

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

// currentNetns returns the inode of this process's network namespace.
func currentNetns() uint64 { return nsInode("net") }

// currentPidns returns the inode of this process's pid namespace.
func currentPidns() uint64 { return nsInode("pid") }

// CurrentPidns is the inode of this process's pid namespace (its
// container's), as AgentHeader carries it.
func CurrentPidns() uint64 { return currentPidns() }

// nsInode is the inode of this process's namespace of kind ("net", "pid").
func nsInode(kind string) uint64 {
	var st syscall.Stat_t
	if err := syscall.Stat("/proc/self/ns/"+kind, &st); err != nil {
		return 0
	}
	return st.Ino
}

func statePath(dir string) string    { return filepath.Join(dir, "agent.json") }
func lockPath(dir string) string     { return filepath.Join(dir, "agent.lock") }
func handoverPath(dir string) string { return filepath.Join(dir, "handover.sock") }

// LocalPath is the agent's local admin socket in its state directory: every
// admin endpoint, the debug ones included (docs/kubernetes.md).
func LocalPath(dir string) string { return filepath.Join(dir, "admin.sock") }

func writeState(dir string, st *State) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create state dir %s: %w", dir, err)
	}
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	tmp := statePath(dir) + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	if err := os.Rename(tmp, statePath(dir)); err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	return nil
}

// ReadState reads the state file an agent left in dir. os.ErrNotExist means no agent
// has run there (or it stopped cleanly).
func ReadState(dir string) (*State, error) {
	b, err := os.ReadFile(statePath(dir))
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("parse %s: %w", statePath(dir), err)
	}
	return &st, nil
}

func removeState(dir string) error {
	err := os.Remove(statePath(dir))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove state file: %w", err)
	}
	return nil
}

// removeFile removes path; a missing file is no error.
func removeFile(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// stateLock is the lock that says an agent runs with a state directory: an
// open-file-description lock (F_OFD_SETLK, like flock: it belongs to the open
// file, not to a pid) on agent.lock, held for the agent's lifetime. The kernel
// drops it when the last descriptor of that open file is closed, whatever
// killed the process, so a crashed agent never blocks the next one, even when
// every agent is pid 1 of its own container. Passing the descriptor to a
// successor (SCM_RIGHTS) hands the lock over without a moment unlocked.
type stateLock struct {
	f *os.File
}

// errLocked means another process holds the lock.
var errLocked = errors.New("another meshdns-ebpf agent holds the state lock")

// openLockFile opens (creating) dir/agent.lock.
func openLockFile(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create state dir %s: %w", dir, err)
	}
	f, err := os.OpenFile(lockPath(dir), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open state lock: %w", err)
	}
	return f, nil
}

// tryLock takes the lock without waiting: errLocked when another agent holds it.
func tryLock(dir string) (*stateLock, error) {
	f, err := openLockFile(dir)
	if err != nil {
		return nil, err
	}
	if err := setLock(f); err != nil {
		f.Close()
		if errors.Is(err, errLocked) {
			return nil, errLocked
		}
		return nil, fmt.Errorf("lock %s: %w", lockPath(dir), err)
	}
	return &stateLock{f: f}, nil
}

// adoptLock wraps a descriptor of the lock file received from the agent that
// held it: the lock is ours from then on.
func adoptLock(f *os.File) *stateLock { return &stateLock{f: f} }

// release drops our descriptor: the lock is released unless a successor holds
// another descriptor of the same open file.
func (l *stateLock) release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// Locked reports whether an agent holds the state lock of dir, without taking
// it (F_OFD_GETLK), so asking never gets in the way of an agent starting.
func Locked(dir string) (bool, error) {
	f, err := os.OpenFile(lockPath(dir), os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open state lock: %w", err)
	}
	defer f.Close()
	held, err := lockHeld(f)
	if err != nil {
		return false, fmt.Errorf("query state lock: %w", err)
	}
	return held, nil
}
