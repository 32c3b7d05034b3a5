//go:build linux

package nodetest

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// hostState is what the node must leave as it found it on the machine: every
// writable sysctl (the machine-wide ones and the machine's own network
// namespace's), the mounts at the paths a node touches, the top-level cgroups of
// every hierarchy, and the node's files at their usual places.
type hostState struct {
	sysctls map[string]string
	mounts  []string
	cgroups map[string]bool // hierarchy/top-level-dir
	paths   map[string]bool // path -> exists
}

// volatileSysctls change on their own (the kernel lowers the perf sample rate,
// any module can taint, every fork moves ns_last_pid).
var volatileSysctls = map[string]bool{
	"kernel/ns_last_pid":                   true,
	"kernel/perf_event_max_sample_rate":    true,
	"kernel/tainted":                       true,
	"kernel/random/write_wakeup_threshold": true,
}

// perInterface matches the per-interface sysctl directories of the machine's
// network namespace: other tests add and remove links there.
var perInterface = regexp.MustCompile(`^net/ipv[46]/(conf|neigh)/[^/]+/`)

// nodePaths are where a node keeps its files when nothing redirects them.
var nodePaths = []string{
	"/var/lib/kubelet", "/var/lib/cni", "/var/lib/containerd", "/run/containerd", "/var/run/containerd",
	"/etc/cni", "/var/log/pods", "/var/log/containers", "/run/meshdns", "/sys/fs/bpf/meshdns", "/etc/kubernetes",
}

// mountWatch are the mount points (and below) a node would mount on.
var mountWatch = []string{"/proc/sys", "/sys/fs/bpf", "/sys/fs/cgroup", "/var/lib", "/var/log", "/var/run", "/run/containerd", "/run/meshdns", "/etc"}

func snapshotHost() (*hostState, error) {
	s := &hostState{sysctls: map[string]string{}, cgroups: map[string]bool{}, paths: map[string]bool{}}
	err := filepath.WalkDir("/proc/sys", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		rel := strings.TrimPrefix(p, "/proc/sys/")
		if volatileSysctls[rel] || perInterface.MatchString(rel) {
			return nil
		}
		info, err := d.Info()
		if err != nil || info.Mode().Perm()&0o200 == 0 || info.Mode().Perm()&0o444 == 0 {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil // write-only or refused: nothing to compare
		}
		s.sysctls[rel] = strings.TrimSpace(string(b))
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read /proc/sys: %w", err)
	}
	if s.mounts, err = watchedMounts(); err != nil {
		return nil, err
	}
	hier, _ := os.ReadDir("/sys/fs/cgroup")
	for _, h := range hier {
		dirs, _ := os.ReadDir(filepath.Join("/sys/fs/cgroup", h.Name()))
		for _, d := range dirs {
			if d.IsDir() {
				s.cgroups[h.Name()+"/"+d.Name()] = true
			}
		}
	}
	for _, p := range nodePaths {
		_, err := os.Lstat(p)
		s.paths[p] = err == nil
	}
	return s, nil
}

// watchedMounts lists the machine's mounts (this process's mount namespace) at or
// below mountWatch, as "mountpoint fstype".
func watchedMounts() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 {
			continue
		}
		mp := fields[4]
		fstype := ""
		for i, x := range fields {
			if x == "-" && i+1 < len(fields) {
				fstype = fields[i+1]
			}
		}
		for _, w := range mountWatch {
			if mp == w || strings.HasPrefix(mp, w+"/") {
				out = append(out, mp+" "+fstype)
				break
			}
		}
	}
	sort.Strings(out)
	return out, sc.Err()
}

// diff lists how after differs from s. name is the node's own name (its netns,
// cgroups and directories carry it); cgroups that other test processes made
// meanwhile (testenv.OwnedName of another pid) are not the node's doing.
func (s *hostState) diff(after *hostState, name string) []string {
	var out []string
	for k, v := range s.sysctls {
		if w, ok := after.sysctls[k]; ok && w != v {
			out = append(out, fmt.Sprintf("sysctl %s: %q before, %q after", k, v, w))
		}
	}
	if a, b := strings.Join(s.mounts, "\n"), strings.Join(after.mounts, "\n"); a != b {
		out = append(out, fmt.Sprintf("mounts at %v changed:\nbefore:\n%s\nafter:\n%s", mountWatch, a, b))
	}
	for cg := range after.cgroups {
		if s.cgroups[cg] {
			continue
		}
		base := filepath.Base(cg)
		if strings.Contains(base, name) || !ownedByOther(base) {
			out = append(out, "cgroup left: /sys/fs/cgroup/"+cg)
		}
	}
	for p, existed := range s.paths {
		if after.paths[p] != existed {
			out = append(out, fmt.Sprintf("%s: existed %v before, %v after", p, existed, after.paths[p]))
		}
	}
	if _, err := os.Stat(filepath.Join("/run/netns", name)); err == nil {
		out = append(out, "netns left: "+name)
	}
	sort.Strings(out)
	return out
}

var ownedName = regexp.MustCompile(`-t[0-9]+-[0-9a-f]+$`)

// ownedByOther reports whether a name was made by testenv.OwnedName in another
// test process (alive or not): not this node's.
func ownedByOther(name string) bool {
	return ownedName.MatchString(name) && !strings.Contains(name, fmt.Sprintf("-t%d-", os.Getpid()))
}
