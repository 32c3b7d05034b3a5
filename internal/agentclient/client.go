// Package agentclient is the CLI's side of the running agent
// (cmd/meshdns-ebpf): it reads the agent's state file and asks its admin
// endpoints (the local socket, or --admin) for the name table, the name
// sources, the Pods of the node and the tap, and runs the container's
// probes. The agent (internal/agent) serves; this package only reads.
package agentclient

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/agentstate"
	"github.com/meshdns/meshdns-ebpf/internal/egressctl"
	"github.com/meshdns/meshdns-ebpf/internal/kubesource"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nameview"
	"github.com/meshdns/meshdns-ebpf/internal/redirect"
	"github.com/meshdns/meshdns-ebpf/internal/tap"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// What the CLI (`table`, `status`, `stats`) reads from the running agent's
// admin endpoints (the agent's debugHandler): on its local socket, or at an
// admin address given with --admin.

// Endpoint is where the CLI reaches the agent's admin endpoints: the local
// socket Socket, or else the admin address Addr.
type Endpoint struct {
	Socket string
	Addr   string
}

// AgentEndpoint is the running agent's admin endpoint: the address override
// when given, else the local socket in stateDir, else the admin address the
// agent's state file records (an agent of a version without a local socket;
// it serves the debug endpoints there).
func AgentEndpoint(stateDir, override string) (Endpoint, error) {
	if override != "" {
		return Endpoint{Addr: override}, nil
	}
	if fi, err := os.Stat(agentstate.LocalPath(stateDir)); err == nil && fi.Mode()&os.ModeSocket != 0 {
		return Endpoint{Socket: agentstate.LocalPath(stateDir)}, nil
	}
	st, err := agentstate.Read(stateDir)
	if errors.Is(err, os.ErrNotExist) {
		return Endpoint{}, fmt.Errorf("no agent socket or state in %s: is the agent running? (an agent in --mode off has none: give --admin ADDR)", stateDir)
	}
	if err != nil {
		return Endpoint{}, err
	}
	if st.Admin == "" {
		return Endpoint{}, errors.New("the agent runs without an admin endpoint (--admin \"\")")
	}
	return Endpoint{Addr: st.Admin}, nil
}

// get asks the agent for path, within ctx (which bounds the body too: the
// tap streams). A status other than 200 is an error with the agent's
// message.
func (e Endpoint) get(ctx context.Context, path string) (*http.Response, error) {
	c, u := http.DefaultClient, adminURL(e.Addr, path)
	if e.Socket != "" {
		c = &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", e.Socket)
			},
			DisableKeepAlives: true, // one request per CLI call: nothing to keep
		}}
		u = "http://agent" + path
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("ask the agent: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		return nil, &statusError{path: path, status: resp.Status, body: strings.TrimSpace(string(b)), header: resp.Header}
	}
	return resp, nil
}

// statusError is the agent's answer other than 200.
type statusError struct {
	path, status, body string
	header             http.Header
}

func (e *statusError) Error() string {
	return fmt.Sprintf("agent %s: %s: %s", e.path, e.status, e.body)
}

// adminURL is the URL of path on the admin address; an unspecified host
// (":9153", "0.0.0.0:9153") is reached on loopback.
func adminURL(admin, path string) string {
	if host, port, err := net.SplitHostPort(admin); err == nil {
		if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
			admin = net.JoinHostPort("127.0.0.1", port)
		}
	}
	return "http://" + admin + path
}

func getJSON(e Endpoint, path string, v any) error {
	return getJSONWithin(e, path, v, 30*time.Second) // a table of 100k names is a few MB
}

func getJSONWithin(e Endpoint, path string, v any, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	resp, err := e.get(ctx, path)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("agent %s: %w", path, err)
	}
	return nil
}

// StreamTap streams the agent's answered queries that f selects (/debug/tap)
// to fn, until ctx ends (then it returns nil), the agent goes away, or fn
// fails. Records the agent could not hand over because this reader was too
// slow arrive as notices (Record.Lost).
func StreamTap(ctx context.Context, e Endpoint, f tap.Filter, fn func(*tap.Record) error) error {
	resp, err := e.get(ctx, "/debug/tap?"+f.Values().Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	err = tap.Read(resp.Body, fn)
	if ctx.Err() != nil {
		return nil
	}
	if err == nil {
		return errors.New("the agent ended the tap stream (did it stop?)")
	}
	return err
}

// ReadTable lists the agent's name table.
func ReadTable(e Endpoint, f nameview.Filter) ([]nameview.Entry, error) {
	q := url.Values{}
	for k, v := range map[string]string{"name": f.Name, "namespace": f.Namespace, "source": f.Source, "client": f.Client} {
		if v != "" {
			q.Set(k, v)
		}
	}
	var out []nameview.Entry
	return out, getJSON(e, "/debug/table?"+q.Encode(), &out)
}

// ReadNDS returns the agent's table in Istio's NameTable JSON as a client
// of namespace ns sees it.
func ReadNDS(e Endpoint, ns string) (*nameview.NameTable, error) {
	var out nameview.NameTable
	return &out, getJSON(e, "/debug/ndsz?"+url.Values{"namespace": {ns}}.Encode(), &out)
}

// ErrNotServed is a path the agent does not serve (404): a part it runs without.
var ErrNotServed = errors.New("not served by this agent")

// ReadEgress returns the agent's DNS-gated egress status; ErrNotServed when
// the agent runs without --egress.
func ReadEgress(e Endpoint) (*egressctl.Status, error) {
	var out egressctl.Status
	err := getJSONWithin(e, "/debug/egress", &out, 2*time.Second)
	var se *statusError
	if errors.As(err, &se) && strings.HasPrefix(se.status, "404") {
		return nil, ErrNotServed
	}
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// ReadSources returns the agent's name sources.
func ReadSources(e Endpoint) ([]names.SourceStatus, error) {
	var out []names.SourceStatus
	return out, getJSONWithin(e, "/debug/sources", &out, 2*time.Second)
}

// PodUID returns the UID of the Pod a cgroup path belongs to, or "".
func PodUID(cgroupPath string) string { return workload.PodUID(cgroupPath) }

// NamePods sets the Pod of each cgroup of s whose path names a Pod the
// agent knows (the Pods of this node).
func NamePods(s *redirect.Stats, pods []kubesource.PodRef) {
	byUID := make(map[string]string, len(pods))
	for _, p := range pods {
		byUID[p.UID] = p.Namespace + "/" + p.Name
	}
	for i := range s.Cgroups {
		if uid := PodUID(s.Cgroups[i].Path); uid != "" {
			s.Cgroups[i].Pod = byUID[uid]
		}
	}
}

// ReadPods returns the Pods of this node the agent knows.
func ReadPods(e Endpoint) ([]kubesource.PodRef, error) {
	var out []kubesource.PodRef
	return out, getJSON(e, "/debug/pods", &out)
}
