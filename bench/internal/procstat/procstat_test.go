package procstat

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestCPUOwnProcess burns 50 ms of CPU, as counted by getrusage (an independent
// account of the same kernel time), and checks that schedstat saw at least most of
// it. It spins on CPU time, not wall time, so a loaded machine cannot fail it.
func TestCPUOwnProcess(t *testing.T) {
	rusage := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	before, err := CPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	ruBefore := rusage()
	giveUp := time.Now().Add(20 * time.Second)
	x := 0
	for rusage()-ruBefore < 50*time.Millisecond && time.Now().Before(giveUp) {
		x++
	}
	burnt := rusage() - ruBefore
	after, err := CPU(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if burnt < 50*time.Millisecond {
		t.Fatalf("could not burn 50ms of CPU in 20s (got %v)", burnt)
	}
	if d := after - before; d < burnt*8/10 {
		t.Errorf("getrusage says %v of CPU was used, schedstat says %v (x=%d)", burnt, d, x)
	}
}

func TestCPUInFakeTree(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ tid, content string }{
		{"1", "1500 200 3\n"}, {"2", "2500 0 1\n"},
	} {
		if err := os.MkdirAll(filepath.Join(dir, tc.tid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, tc.tid, "schedstat"), []byte(tc.content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := cpuIn(dir)
	if err != nil || got != 4000 {
		t.Errorf("cpuIn = %v, %v; want 4µs", got, err)
	}
	if _, err := cpuIn(filepath.Join(dir, "missing")); err == nil {
		t.Error("missing dir: no error")
	}
}

func TestMemory(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name, status string
		want         Mem
		wantErr      bool
	}{
		{"ok", "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t3\n", Mem{RSS: 1 << 20, HWM: 2 << 20}, false},
		{"missing", "Name:\tx\nVmRSS:\t  1024 kB\n", Mem{}, true},
		{"bad unit", "VmHWM:\t2 MB\nVmRSS:\t1 MB\n", Mem{}, true},
	} {
		p := filepath.Join(dir, tc.name)
		if err := os.WriteFile(p, []byte(tc.status), 0o644); err != nil {
			t.Fatal(err)
		}
		got, err := memoryFrom(p)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("%s: got %+v, %v; want %+v, err=%v", tc.name, got, err, tc.want, tc.wantErr)
		}
	}
	m, err := Memory(os.Getpid())
	if err != nil || m.RSS == 0 || m.HWM < m.RSS {
		t.Errorf("own memory = %+v, %v", m, err)
	}
}

func TestParseStat(t *testing.T) {
	const stat = "cpu  10 0 10 80 0 0 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0 0 0\ncpu1 1 1 1 90 5 1 1 0 7 0\nintr 1 2\n"
	got, err := parseStat(stat)
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]cpuTicks{0: {idle: 40, total: 50}, 1: {idle: 95, total: 100}}
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("parseStat = %v, want %v", got, want)
	}
	if _, err := parseStat("intr 1\n"); err == nil {
		t.Error("no cpu lines: no error")
	}
	busy, err := CoreBusy([]int{0}, 20*time.Millisecond)
	if err != nil || busy[0] < 0 || busy[0] > 1 {
		t.Errorf("CoreBusy = %v, %v", busy, err)
	}
}
