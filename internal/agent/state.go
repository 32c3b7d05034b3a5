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

// DefaultStateDir holds the running agent's state file, read by `status` and
// `cleanup`.
const DefaultStateDir = "/run/meshdns"

// State is what a running agent tells the CLI about itself.
type State struct {
	PID         int        `json:"pid"`
	Mode        string     `json:"mode"`        // ebpf, iptables or off
	ModeReason  string     `json:"mode_reason"` // why auto picked this mode
	Listen      []string   `json:"listen"`      // resolver addresses (UDP and TCP)
	SlotPorts   []uint16   `json:"slot_ports"`  // ports per captured nameserver slot (ebpf)
	Nameservers []string   `json:"nameservers"` // captured destinations
	CaptureAll  bool       `json:"capture_all"`
	Upstreams   []string   `json:"upstreams"`
	Cgroup      string     `json:"cgroup,omitempty"`
	BPFFS       string     `json:"bpffs,omitempty"`
	Backend     string     `json:"iptables_backend,omitempty"`
	Admin       string     `json:"admin,omitempty"`
	NodeAddrs   []NodeAddr `json:"node_addrs,omitempty"`
	Persist     bool       `json:"persist"`
	Started     time.Time  `json:"started"`
	Netns       uint64     `json:"netns"` // inode of the agent's network namespace
}

// currentNetns returns the inode of this process's network namespace.
func currentNetns() uint64 {
	var st syscall.Stat_t
	if err := syscall.Stat("/proc/self/ns/net", &st); err != nil {
		return 0
	}
	return st.Ino
}

func statePath(dir string) string { return filepath.Join(dir, "agent.json") }

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
	_ = os.Remove(dir) // only when empty
	return nil
}

// Alive reports whether the process that wrote st still runs.
func (st *State) Alive() bool {
	if st.PID <= 0 {
		return false
	}
	err := syscall.Kill(st.PID, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}
