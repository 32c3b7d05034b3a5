package node

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const agentNS = "meshdns-system"

// agentPod is one pod of the DaemonSet as kubectl reports it.
type agentPod struct {
	Metadata struct {
		Name              string     `json:"name"`
		DeletionTimestamp *time.Time `json:"deletionTimestamp"`
	} `json:"metadata"`
	Status struct {
		Phase      string `json:"phase"`
		Conditions []struct {
			Type, Status string
		} `json:"conditions"`
		ContainerStatuses []struct {
			ContainerID  string `json:"containerID"`
			RestartCount int    `json:"restartCount"`
			Ready        bool   `json:"ready"`
			State        struct {
				Waiting *struct{ Reason, Message string } `json:"waiting"`
			} `json:"state"`
		} `json:"containerStatuses"`
	} `json:"status"`
}

func (p agentPod) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

// agentPods lists the DaemonSet's pods.
func (e *env) agentPods(t *testing.T) []agentPod {
	t.Helper()
	var list struct {
		Items []agentPod `json:"items"`
	}
	kubectlJSON(t, e.n, &list, "get", "pods", "-n", agentNS, "-l", "app.kubernetes.io/name=meshdns-ebpf")
	return list.Items
}

// waitSettled waits until the DaemonSet has exactly one pod, Ready and not being
// deleted (a rollout's old pod is gone), and its agent serves, and returns it.
func (e *env) waitSettled(t *testing.T, d time.Duration) agentPod {
	t.Helper()
	var p agentPod
	waitFor(t, d, "one Ready agent pod, its predecessor gone", func() bool {
		pods := e.agentPods(t)
		if len(pods) != 1 || pods[0].Metadata.DeletionTimestamp != nil || !pods[0].ready() {
			return false
		}
		p = pods[0]
		return true
	})
	e.waitServing(t, p.Metadata.Name)
	return p
}

// agentPID is the host pid of the agent container's process in pod.
func (e *env) agentPID(t *testing.T, p agentPod) int {
	t.Helper()
	if len(p.Status.ContainerStatuses) == 0 {
		t.Fatalf("pod %s has no container status", p.Metadata.Name)
	}
	id := strings.TrimPrefix(p.Status.ContainerStatuses[0].ContainerID, "containerd://")
	out, err := e.n.Ctr("tasks", "ls")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 && f[0] == id {
			pid, err := strconv.Atoi(f[1])
			if err == nil {
				return pid
			}
		}
	}
	t.Fatalf("no task for container %s in:\n%s", id, out)
	return 0
}

// alive reports whether any thread of the process pid still runs.
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	// A killed process's leader is a zombie while its other threads still
	// exit, and its sockets close only with the last of them: it is gone
	// when the leader is a zombie alone.
	st := string(b)
	return !strings.Contains(st, "\nState:\tZ") || !strings.Contains(st, "\nThreads:\t1\n")
}

// agentLog is a pod's agent log (JSON lines), all of it.
func (e *env) agentLog(t *testing.T, pod string) string {
	t.Helper()
	out, err := e.n.Kubectl("logs", "-n", agentNS, pod)
	if err != nil {
		t.Logf("logs of %s: %v", pod, err)
	}
	return out
}

// logTimes returns the time of the agent's first log line and of the first line
// whose msg has any of msgs (zero when none).
func logTimes(log string, msgs ...string) (first, at time.Time, which string) {
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var l struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			continue
		}
		if first.IsZero() {
			first = l.Time
		}
		for _, m := range msgs {
			if l.Msg == m {
				return first, l.Time, m
			}
		}
	}
	return first, time.Time{}, ""
}

// servingMsgs are the log lines of an agent that serves: it took over from its
// predecessor, or (none, or it had died) turned capture on itself.
var servingMsgs = []string{"took over from the previous agent", "resolver ready: capture on"}

// takeover says how long after its first log line the pod's agent served, and
// when (zero: not yet).
func (e *env) takeover(t *testing.T, pod string) (time.Duration, time.Time, string) {
	t.Helper()
	first, at, which := logTimes(e.agentLog(t, pod), servingMsgs...)
	if at.IsZero() {
		return 0, at, "never logged taking over or capture on"
	}
	d := at.Sub(first)
	return d, at, fmt.Sprintf("%q %v after its first log line", which, d.Round(time.Millisecond))
}

// logSummary lists an agent's log messages with their offset from its first
// line (the story of a takeover), at most n.
func logSummary(log string, n int) string {
	var b strings.Builder
	var first time.Time
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for i := 0; sc.Scan() && i < n; i++ {
		var l struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &l) != nil {
			fmt.Fprintf(&b, "  %s\n", sc.Text())
			continue
		}
		if first.IsZero() {
			first = l.Time
		}
		fmt.Fprintf(&b, "  +%v %s\n", l.Time.Sub(first).Round(time.Millisecond), l.Msg)
	}
	return b.String()
}

// waitServing waits until the pod's agent logs that it serves.
func (e *env) waitServing(t *testing.T, pod string) {
	t.Helper()
	waitFor(t, 2*time.Minute, "agent "+pod+" serves", func() bool {
		_, at, _ := e.takeover(t, pod)
		return !at.IsZero()
	})
}

// containerCgroup is the cgroup2 directory of pid.
func containerCgroup(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "0::"); ok {
			return filepath.Join("/sys/fs/cgroup/unified", rest)
		}
	}
	t.Fatalf("pid %d has no cgroup2 path in:\n%s", pid, b)
	return ""
}
