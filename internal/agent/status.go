package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/ctzone"
	"github.com/meshdns/meshdns-ebpf/internal/nodeaddr"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
)

// Cleanup removes what a crashed or stopped agent left: pinned links and maps
// (which detaches the programs), iptables chains and rules, the node address it
// added, and its state file. It holds the state lock while it works, and refuses
// while an agent holds it. It is safe to run on a clean node.
func Cleanup(stateDir, pinDir string, log *slog.Logger) ([]string, error) {
	var removed []string
	var errs []error
	lock, err := agentstate.TryLock(stateDir)
	if errors.Is(err, agentstate.ErrLocked) {
		pid := "?"
		if st, err := agentstate.Read(stateDir); err == nil {
			pid = fmt.Sprint(st.PID)
		}
		return nil, fmt.Errorf("an agent (pid %s per its state file) holds the lock of %s: stop it first", pid, stateDir)
	}
	if err != nil {
		return nil, err
	}
	defer lock.Release()
	st, _ := agentstate.Read(stateDir)
	r, err := redirect.Cleanup(agentstate.PinDir(stateDir, pinDir))
	removed = append(removed, r...)
	if err != nil {
		errs = append(errs, err)
	}
	backend := ""
	if st != nil {
		backend = st.Backend
	}
	r, err = ctzone.Cleanup(backend)
	removed = append(removed, r...)
	if err != nil {
		errs = append(errs, err)
	}
	if st != nil && len(st.NodeAddrs) > 0 && st.Netns != 0 && st.Netns != agentstate.Netns() {
		errs = append(errs, fmt.Errorf("the agent ran in another network namespace (inode %d); run cleanup there to remove its addresses %v", st.Netns, st.NodeAddrs))
		return removed, errors.Join(errs...)
	}
	if st != nil {
		if err := nodeaddr.Remove(st.NodeAddrs, log); err != nil {
			errs = append(errs, err)
		} else {
			for _, na := range st.NodeAddrs {
				if na.CreatedLink {
					removed = append(removed, "link "+na.Link)
				} else {
					removed = append(removed, "address "+na.Addr+" on "+na.Link)
				}
			}
		}
		if err := agentstate.Remove(stateDir); err != nil {
			errs = append(errs, err)
		} else {
			removed = append(removed, "state file "+agentstate.StatePath(stateDir))
		}
	}
	for what, p := range map[string]string{"handover socket": agentstate.HandoverPath(stateDir), "local admin socket": agentstate.LocalPath(stateDir)} {
		if err := os.Remove(p); err == nil {
			removed = append(removed, what+" "+p)
		}
	}
	return removed, errors.Join(errs...)
}
