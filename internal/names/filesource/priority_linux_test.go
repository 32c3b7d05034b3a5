package filesource

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// threadNice reads the nice value of the calling thread.
func threadNice(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/stat", unix.Gettid()))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command's closing parenthesis: state is field 3,
	// nice field 19.
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	n, err := strconv.Atoi(f[19-3])
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A reload runs at nice 19 on a thread of its own, which ends with it, and
// leaves the caller's thread as it was.
func TestBackgroundRunsAtLowPriority(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	before := threadNice(t)
	var in int
	var tid int
	background(func() {
		in, tid = threadNice(t), unix.Gettid()
	})
	if in != 19 {
		t.Errorf("nice %d inside, want 19", in)
	}
	if tid == unix.Gettid() {
		t.Error("ran on the caller's thread")
	}
	if after := threadNice(t); after != before {
		t.Errorf("the caller's thread went from nice %d to %d", before, after)
	}
	gone := func() bool {
		_, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", tid))
		return err != nil
	}
	if !testenv.WaitFor(5*time.Second, gone) {
		t.Errorf("thread %d of the reload still exists", tid)
	}
}
