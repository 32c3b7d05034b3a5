package agentclient

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
)

// Probes a kubelet runs inside the agent's container (`meshdns-ebpf probe`,
// the DaemonSet's exec probes). The node's admin address cannot carry them: in
// a surge rollout the new pod shares it with its predecessor (hostNetwork),
// which answers the new pod's probes long before the new agent has taken
// anything over. The probe asks the agent serving the state dir's local
// socket, which names itself (agentstate.AgentHeader), and tells this container's agent
// (its pid namespace is the probe's) from a predecessor or successor.

// Probe checks: ProbeReady or ProbeLive.
const (
	// ProbeReady passes when this container's agent serves the node and is
	// ready: a predecessor's readiness never counts.
	ProbeReady = "ready"
	// ProbeLive passes when this container's agent is live, or when another
	// agent serves the node (this one is starting and taking over, or has
	// handed over and waits for its SIGTERM): neither is a reason to restart
	// this container.
	ProbeLive = "live"
)

// probeTimeout bounds one probe; the DaemonSet's timeoutSeconds is longer.
const probeTimeout = 3 * time.Second

// Probe runs check against the agent serving stateDir's local socket.
func Probe(stateDir, check string) error {
	path := map[string]string{ProbeReady: "/readyz", ProbeLive: "/healthz"}[check]
	if path == "" {
		return fmt.Errorf("probe %q: want %s or %s", check, ProbeReady, ProbeLive)
	}
	e := Endpoint{Socket: agentstate.LocalPath(stateDir)}
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	resp, err := e.get(ctx, path)
	var notOK *statusError
	var header http.Header
	switch {
	case errors.As(err, &notOK):
		header = notOK.header
	case err != nil:
		return fmt.Errorf("no agent answers on %s: %w", e.Socket, err)
	default:
		header = resp.Header
		resp.Body.Close()
	}
	pid, pidns := parseAgentID(header.Get(agentstate.AgentHeader))
	if pidns == 0 || pidns != agentstate.Pidns() {
		if check == ProbeLive {
			return nil
		}
		return fmt.Errorf("not ready: the agent serving this node (pid %d in pid namespace %d) is not this container's: it has not taken over yet", pid, pidns)
	}
	if notOK != nil {
		return fmt.Errorf("%s: %s", path, notOK.body)
	}
	return nil
}

// parseAgentID reads an agentHeader value ("pid=12 pidns=4026531836"); 0s
// when it is missing (an agent of a version that does not send it).
func parseAgentID(v string) (pid int, pidns uint64) {
	for _, f := range strings.Fields(v) {
		k, val, _ := strings.Cut(f, "=")
		switch k {
		case "pid":
			pid, _ = strconv.Atoi(val)
		case "pidns":
			pidns, _ = strconv.ParseUint(val, 10, 64)
		}
	}
	return pid, pidns
}
