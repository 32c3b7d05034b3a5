package agentstate

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"
)

func TestStateRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if _, err := Read(dir); !os.IsNotExist(err) {
		t.Fatalf("Read on an empty dir: %v, want not-exist", err)
	}
	st := &State{PID: os.Getpid(), Mode: ModeEBPF, Listen: []string{"169.254.20.53:53"},
		NodeAddrs: []NodeAddr{{Link: "lo", Addr: "169.254.20.53/32"}}, Netns: Netns()}
	if err := Write(dir, st); err != nil {
		t.Fatal(err)
	}
	got, err := Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, st) {
		t.Errorf("round trip: got %+v, want %+v", got, st)
	}
	if err := Remove(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(StatePath(dir)); !os.IsNotExist(err) {
		t.Errorf("state file left after Remove: %v", err)
	}
}

// The state lock belongs to the open file, not to a pid: a second agent is
// refused while the first holds it, a descriptor passed on (a handover) keeps
// it held after the first lets go, and a holder killed with SIGKILL releases
// it, whatever its pid (pid 1 of a container included).
func TestStateLock(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if locked, err := Locked(dir); err != nil || locked {
		t.Fatalf("Locked on a fresh dir: %v %v", locked, err)
	}
	first, err := TryLock(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := TryLock(dir); !errors.Is(err, ErrLocked) {
		t.Fatalf("second TryLock: %v, want ErrLocked", err)
	}
	if locked, _ := Locked(dir); !locked {
		t.Errorf("Locked = false while held")
	}
	// A child process holds a descriptor of the same open file (as a successor
	// that received it): the lock outlives our descriptor, and dies with the child.
	child := exec.Command("sleep", "60")
	child.ExtraFiles = []*os.File{first.File()}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Wait()
	if err := first.Release(); err != nil {
		t.Fatal(err)
	}
	if locked, _ := Locked(dir); !locked {
		t.Errorf("Locked = false while the child holds the passed descriptor")
	}
	if _, err := TryLock(dir); !errors.Is(err, ErrLocked) {
		t.Errorf("TryLock while the child holds it: %v", err)
	}
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = child.Wait()
	if locked, _ := Locked(dir); locked {
		t.Errorf("Locked = true after the holder was killed")
	}
	again, err := TryLock(dir)
	if err != nil {
		t.Fatalf("TryLock after the holder was killed: %v", err)
	}
	again.Release()
}

// TestPinDir: the CLI's --bpffs wins when given, else the agent's state file
// says where it pinned, else the default; stats, status and cleanup share it.
func TestPinDir(t *testing.T) {
	withState := filepath.Join(t.TempDir(), "state")
	if err := Write(withState, &State{PID: 1, BPFFS: "/sys/fs/bpf/from-state"}); err != nil {
		t.Fatal(err)
	}
	noState := filepath.Join(t.TempDir(), "none")
	for _, tc := range []struct{ stateDir, flag, want string }{
		{withState, "", "/sys/fs/bpf/from-state"},
		{withState, "/sys/fs/bpf/given", "/sys/fs/bpf/given"},
		{noState, "", DefaultBPFFS},
		{noState, "/sys/fs/bpf/given", "/sys/fs/bpf/given"},
	} {
		if got := PinDir(tc.stateDir, tc.flag); got != tc.want {
			t.Errorf("PinDir(%s, %q) = %s, want %s", tc.stateDir, tc.flag, got, tc.want)
		}
	}
}
