package agenttest

import (
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestLogKeepsAtMostMaxAndCountsEverythingWritten(t *testing.T) {
	l := &Log{Max: 8}
	for _, s := range []string{"abcde", "fghij", "klm"} {
		if n, err := l.Write([]byte(s)); n != len(s) || err != nil {
			t.Fatalf("Write(%q) = %d, %v: a dropped write must still count as written", s, n, err)
		}
	}
	if got := l.String(); got != "abcdefgh" {
		t.Errorf("log = %q, want the first 8 bytes", got)
	}
}

func TestLogTailAndWaitFor(t *testing.T) {
	l := &Log{}
	l.Write([]byte("one\ntwo\nthree"))
	if got := l.Tail(2); got != "two\nthree" {
		t.Errorf("Tail(2) = %q", got)
	}
	go func() {
		time.Sleep(20 * time.Millisecond) // written after WaitFor starts: the case under test
		l.Write([]byte("\nready"))
	}()
	if !l.WaitFor("ready", 5*time.Second) {
		t.Errorf("WaitFor missed a line written later")
	}
	if l.WaitFor("never", 50*time.Millisecond) {
		t.Errorf("WaitFor found a line never written")
	}
}

func TestProcessOutputExitStatusAndStop(t *testing.T) {
	p := Start(t, Command("sh", "-c", "echo started; exit 3"), Options{})
	ok, err := p.Wait(10 * time.Second)
	if !ok || err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("Wait = %v, %v; want exit status 3", err, ok)
	}
	if !p.Exited() || !p.Log.Contains("started") {
		t.Errorf("exited %v, log %q", p.Exited(), p.Log.String())
	}

	sleeper := Start(t, Command("sleep", "60"), Options{})
	sleeper.MustRun(t)
	if ok, _ := sleeper.Wait(10 * time.Millisecond); ok {
		t.Fatal("a sleeping process reported as exited")
	}
	if err := sleeper.Stop(StopGrace); err == nil || !strings.Contains(err.Error(), "terminated") {
		t.Errorf("Stop = %v, want the SIGTERM exit", err)
	}

	stubborn := Start(t, Command("sh", "-c", "trap '' TERM; echo trapped; exec sleep 60"), Options{})
	if !stubborn.Log.WaitFor("trapped", 10*time.Second) {
		t.Fatal("the shell did not start")
	}
	if ok, err := stubborn.SignalAndWait(syscall.SIGTERM, 100*time.Millisecond); ok {
		t.Fatalf("a process ignoring SIGTERM exited: %v", err)
	}
	if err := stubborn.Stop(100 * time.Millisecond); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Stop = %v, want the SIGKILL after the grace", err)
	}
}
