// Package procstat reads a process's exact CPU time and memory from /proc:
// per-thread run time from /proc/PID/task/*/schedstat (first field, ns; exact
// even on tick-accounted kernels where rusage and /proc/stat are sampled) and
// VmRSS/VmHWM from /proc/PID/status.
package procstat

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// CPU returns the sum of the run time of every live thread of pid. Threads that
// exit between two samples take their time with them; Go runtimes and the C
// servers benchmarked here keep their threads.
func CPU(pid int) (time.Duration, error) {
	return cpuIn(fmt.Sprintf("/proc/%d/task", pid))
}

func cpuIn(taskDir string) (time.Duration, error) {
	tasks, err := os.ReadDir(taskDir)
	if err != nil {
		return 0, fmt.Errorf("list threads %s: %w", taskDir, err)
	}
	var total int64
	read := 0
	for _, t := range tasks {
		data, err := os.ReadFile(filepath.Join(taskDir, t.Name(), "schedstat"))
		if err != nil {
			continue // thread exited
		}
		f := strings.Fields(string(data))
		if len(f) < 1 {
			continue
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parse %s/%s/schedstat %q: %w", taskDir, t.Name(), data, err)
		}
		total += ns
		read++
	}
	if read == 0 {
		return 0, fmt.Errorf("no readable schedstat under %s", taskDir)
	}
	return time.Duration(total), nil
}

// Mem is a process's resident memory in bytes.
type Mem struct {
	RSS, HWM uint64 // VmRSS, VmHWM (peak)
}

// Memory reads VmRSS and VmHWM of pid.
func Memory(pid int) (Mem, error) {
	return memoryFrom(fmt.Sprintf("/proc/%d/status", pid))
}

func memoryFrom(path string) (Mem, error) {
	f, err := os.Open(path)
	if err != nil {
		return Mem{}, fmt.Errorf("open %s: %w", path, err)
	}
	defer f.Close()
	var m Mem
	found := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok || (key != "VmRSS" && key != "VmHWM") {
			continue
		}
		fl := strings.Fields(val)
		if len(fl) != 2 || fl[1] != "kB" {
			return Mem{}, fmt.Errorf("parse %s %s: %q", path, key, val)
		}
		kb, err := strconv.ParseUint(fl[0], 10, 64)
		if err != nil {
			return Mem{}, fmt.Errorf("parse %s %s: %w", path, key, err)
		}
		if key == "VmRSS" {
			m.RSS = kb * 1024
		} else {
			m.HWM = kb * 1024
		}
		found++
	}
	if err := sc.Err(); err != nil {
		return Mem{}, fmt.Errorf("read %s: %w", path, err)
	}
	if found != 2 {
		return Mem{}, fmt.Errorf("%s: VmRSS/VmHWM missing", path)
	}
	return m, nil
}

// CoreBusy samples /proc/stat twice, d apart, and returns the busy fraction of
// each listed core (tick-sampled by the kernel: good to spot other work on a
// core that should be idle, not to measure a server).
func CoreBusy(cores []int, d time.Duration) (map[int]float64, error) {
	a, err := readStat()
	if err != nil {
		return nil, err
	}
	time.Sleep(d)
	b, err := readStat()
	if err != nil {
		return nil, err
	}
	out := map[int]float64{}
	for _, c := range cores {
		x, okA := a[c]
		y, okB := b[c]
		if !okA || !okB {
			return nil, fmt.Errorf("cpu%d not in /proc/stat", c)
		}
		total := float64(y.total - x.total)
		if total <= 0 {
			out[c] = 0
			continue
		}
		out[c] = 1 - float64(y.idle-x.idle)/total
	}
	return out, nil
}

type cpuTicks struct{ idle, total uint64 }

// Ticks is a snapshot of the per-core counters in /proc/stat.
type Ticks map[int]cpuTicks

// ReadTicks snapshots /proc/stat.
func ReadTicks() (Ticks, error) { return readStat() }

// BusySince is the busy fraction of core between an earlier snapshot and t
// (-1 when the core is missing or no time passed).
func (t Ticks) BusySince(earlier Ticks, core int) float64 {
	x, okA := earlier[core]
	y, okB := t[core]
	if !okA || !okB || y.total <= x.total {
		return -1
	}
	return 1 - float64(y.idle-x.idle)/float64(y.total-x.total)
}

func readStat() (map[int]cpuTicks, error) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return nil, fmt.Errorf("read /proc/stat: %w", err)
	}
	return parseStat(string(data))
}

// parseStat reads the per-core "cpuN user nice system idle iowait irq softirq
// steal ..." lines; idle includes iowait.
func parseStat(s string) (map[int]cpuTicks, error) {
	out := map[int]cpuTicks{}
	for line := range strings.SplitSeq(s, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || !strings.HasPrefix(f[0], "cpu") || f[0] == "cpu" {
			continue
		}
		n, err := strconv.Atoi(f[0][3:])
		if err != nil {
			continue
		}
		var t cpuTicks
		for i, v := range f[1:] {
			if i >= 8 { // guest time is already in user
				break
			}
			x, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("parse /proc/stat %q: %w", line, err)
			}
			t.total += x
			if i == 3 || i == 4 {
				t.idle += x
			}
		}
		out[n] = t
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no per-cpu lines in /proc/stat")
	}
	return out, nil
}
