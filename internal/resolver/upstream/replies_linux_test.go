//go:build linux

package upstream

import (
	"testing"
	"time"

	"github.com/miekg/dns"
	"golang.org/x/sys/unix"
)

// A resolver reader that claims the replies reads them itself: the
// forwarder's own goroutine leaves a reply in its socket (the claimed
// descriptor turns readable), ReadReplies ends the resolution in the caller's
// goroutine with the whole answer, and one claimant at a time has them. Once
// released, the forwarder reads them again; once it is closed, ReadReplies
// says so and nobody can claim them.
func TestClaimedRepliesAreReadByTheClaimant(t *testing.T) {
	up := startFake(t, answerA(300))
	f, _, _ := testForwarder(t, NewConfig(up.addr))
	fd, ok := f.ClaimReplies()
	if !ok {
		t.Fatal("ClaimReplies: not offered")
	}
	if _, again := f.ClaimReplies(); again {
		t.Fatal("a second claimant got the replies too")
	}

	req := query("claimed.example.", dns.TypeA, 7)
	type result struct {
		a   Answer
		err error
	}
	got := make(chan result, 1)
	f.ForwardAsync(toQuery(req), func(a Answer, err error) { got <- result{a, err} })
	waitReadable(t, fd)
	select {
	case r := <-got:
		t.Fatalf("answered before the claimant read the reply: %v %v", r.a.Source, r.err)
	default:
	}
	if !f.ReadReplies(1) {
		t.Fatal("ReadReplies: closed")
	}
	var r result
	select {
	case r = <-got:
	default:
		t.Fatal("the reply read did not end the resolution in ReadReplies")
	}
	if r.err != nil || r.a.Source != SourceUpstream {
		t.Fatalf("answer: source %v, err %v", r.a.Source, r.err)
	}
	resp := toMsg(t, req, r.a)
	checkAnswers(t, req, resp)
	if len(resp.Answer) != 1 || resp.Answer[0].(*dns.A).A.String() != "192.0.2.1" {
		t.Errorf("answer %v, want claimed.example. A 192.0.2.1", resp.Answer)
	}

	f.ReleaseReplies()
	forward(t, f, query("released.example.", dns.TypeA, 8)) // the forwarder's goroutine reads it

	if _, ok := f.ClaimReplies(); !ok {
		t.Fatal("ClaimReplies after a release: not offered")
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if f.ReadReplies(1) {
		t.Error("ReadReplies after Close: still open")
	}
	f.ReleaseReplies()
	if _, ok := f.ClaimReplies(); ok {
		t.Error("ClaimReplies after Close: offered")
	}
}

// waitReadable waits until fd is readable: a reply waits unread.
func waitReadable(t *testing.T, fd int) {
	t.Helper()
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if n, err := unix.Poll(fds, int(time.Until(deadline).Milliseconds())+1); err == nil && n > 0 {
			return
		}
	}
	t.Fatal("no reply arrived within 5s")
}
