package upstream

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

const testMark = 0x3f53

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		testenv.Skip(t, "setting SO_MARK needs root (running as uid %d)", os.Geteuid())
	}
}

// TestMarkSetOnUpstreamSockets reads SO_MARK back from every upstream socket (UDP, the
// TCP retry and the health probe) and checks the kernel's own view with ss(8).
func TestMarkSetOnUpstreamSockets(t *testing.T) {
	requireRoot(t)
	ssPath, ssErr := exec.LookPath("ss")
	var mu sync.Mutex
	var marks []int
	testHookControl = func(fd uintptr) {
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK)
		if err != nil {
			t.Errorf("getsockopt SO_MARK: %v", err)
		}
		mu.Lock()
		marks = append(marks, v)
		mu.Unlock()
	}
	t.Cleanup(func() { testHookControl = nil })

	up := startFake(t, func(proto string, req *dns.Msg) []*dns.Msg {
		m := new(dns.Msg)
		m.SetReply(req)
		if proto == "udp" {
			m.Truncated = true // force the TCP retry too
		} else {
			m.Answer = []dns.RR{mustRR("%s 300 IN A 192.0.2.1", req.Question[0].Name)}
		}
		return []*dns.Msg{m}
	})
	up.SetDelay(300 * time.Millisecond)
	cfg := NewConfig(up.addr)
	cfg.Mark = testMark
	f, _, _ := testForwarder(t, cfg)

	done := make(chan error, 1)
	go func() {
		_, _, err := forwardMsg(t, context.Background(), f, query("marked.example.", dns.TypeA, 1))
		done <- err
	}()
	if ssErr == nil {
		// While each exchange waits on the delayed fake, the kernel lists the socket.
		for _, proto := range []string{"-u", "-t"} {
			seen := false
			deadline := time.Now().Add(time.Second)
			for !seen && time.Now().Before(deadline) {
				out, err := exec.Command(ssPath, proto, "-a", "-n", "-e", "dst", up.addr.String()).CombinedOutput()
				if err != nil {
					t.Fatalf("ss: %v: %s", err, out)
				}
				for _, l := range strings.Split(string(out), "\n") {
					if strings.Contains(l, up.addr.String()) {
						seen = true
						if !strings.Contains(l, "fwmark:0x3f53") {
							t.Errorf("ss %s: upstream socket without the mark: %s", proto, l)
						}
					}
				}
				time.Sleep(10 * time.Millisecond)
			}
			if !seen {
				t.Errorf("ss %s never listed the upstream socket", proto)
			}
		}
	} else {
		t.Logf("ss not on PATH, checking SO_MARK by getsockopt only: %v", ssErr)
	}
	if err := <-done; err != nil {
		t.Fatalf("Forward: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	// New's privilege check, the UDP and the TCP socket.
	if len(marks) < 3 {
		t.Fatalf("saw %d marked sockets, want >= 3", len(marks))
	}
	for _, m := range marks {
		if m != testMark {
			t.Errorf("socket mark %#x, want %#x", m, testMark)
		}
	}
}

func TestNoMarkWhenZero(t *testing.T) {
	requireRoot(t)
	var marks []int
	var mu sync.Mutex
	testHookControl = func(fd uintptr) {
		v, _ := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK)
		mu.Lock()
		marks = append(marks, v)
		mu.Unlock()
	}
	t.Cleanup(func() { testHookControl = nil })
	up := startFake(t, answerA(300))
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	forward(t, f, query("unmarked.example.", dns.TypeA, 1))
	mu.Lock()
	defer mu.Unlock()
	if len(marks) != 1 || marks[0] != 0 {
		t.Errorf("marks %v, want one unmarked socket", marks)
	}
}

// TestMarkWithoutPrivilege drops the effective UID of one locked OS thread to nobody
// (the process keeps root elsewhere) and checks that Start refuses to run unmarked.
func TestMarkWithoutPrivilege(t *testing.T) {
	requireRoot(t)
	type result struct{ errMark, errNoMark error }
	res := make(chan result, 1)
	go func() {
		// The thread is never unlocked: the runtime discards it when this goroutine
		// ends, so its changed credentials cannot leak to other goroutines.
		runtime.LockOSThread()
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 65534, ^uintptr(0)); e != 0 {
			res <- result{errMark: e}
			return
		}
		start := func(mark uint32) error {
			cfg := NewConfig(startFake(t, answerA(300)).addr)
			cfg.Mark = mark
			f, err := New(cfg)
			if err != nil {
				return err
			}
			defer f.Close()
			return f.Start(context.Background())
		}
		res <- result{start(testMark), start(0)}
	}()
	r := <-res
	if r.errMark == nil || !errors.Is(r.errMark, ErrMark) || !errors.Is(r.errMark, unix.EPERM) || !strings.Contains(r.errMark.Error(), "CAP_NET_ADMIN") {
		t.Errorf("Start with mark as nobody: %v, want a clear SO_MARK EPERM error", r.errMark)
	}
	if r.errNoMark != nil {
		t.Errorf("Start without mark as nobody: %v", r.errNoMark)
	}
}
