package redirect

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// 70,000 captured sockets open at once (more than the 65,536 entries
// the old LRU map held) all keep their state: each socket connects (redirected,
// state recorded), and once all of them are connected each sends its query;
// every reply comes from the nameserver the socket asked.
func TestManyCapturedSockets(t *testing.T) {
	n := newTestNet(t)
	n.start(t, n.config())
	const sockets = 70000
	// Each source address has one range of ephemeral ports: use three.
	srcs := []string{"169.254.60.1", "169.254.60.2", "169.254.60.3"}
	for _, a := range srcs {
		n.node.IP(t, "addr", "add", a+"/32", "dev", "lo")
	}
	// A process may hold RLIMIT_NOFILE descriptors: spread the sockets over
	// enough clients, all open at once.
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	per := int(lim.Max) - 200
	if per > sockets {
		per = sockets
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	type client struct {
		cmd    *exec.Cmd
		stdin  io.WriteCloser
		stdout *bufio.Reader
		stderr bytes.Buffer
	}
	var clients []*client
	start := time.Now()
	for left := sockets; left > 0; left -= per {
		c := &client{cmd: n.clientCmd(ctx, proc{uid: 0}, "-mode=many", fmt.Sprintf("-n=%d", min(per, left)), "-dst="+hp(ns1, 53), "-timeout=5s",
			"-src="+strings.Join(srcs, ","))}
		c.cmd.Stderr = &c.stderr
		var err error
		if c.stdin, err = c.cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		out, err := c.cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		c.stdout = bufio.NewReader(out)
		if err := c.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer c.cmd.Wait()
		defer c.stdin.Close()
		clients = append(clients, c)
		if line, err := c.stdout.ReadString('\n'); err != nil || strings.TrimSpace(line) != "OPEN" {
			t.Fatalf("client: %q %v\n%s", line, err, c.stderr.String())
		}
	}
	// One client queries at a time (the others keep their sockets open).
	var total manyResult
	for _, c := range clients {
		io.WriteString(c.stdin, "go\n")
		line, err := c.stdout.ReadString('\n')
		if err != nil {
			t.Fatalf("client: %v\n%s", err, c.stderr.String())
		}
		var res manyResult
		if err := json.Unmarshal([]byte(line), &res); err != nil {
			t.Fatalf("client output %q: %v", line, err)
		}
		total.Sockets += res.Sockets
		total.Answered += res.Answered
		total.WrongSrc += res.WrongSrc
		total.Lost += res.Lost
	}
	t.Logf("%d captured sockets connected at once (%d clients), then one query each, in %v: %d answered from the nameserver asked, %d from the wrong source, %d lost",
		total.Sockets, len(clients), time.Since(start).Round(time.Millisecond), total.Answered, total.WrongSrc, total.Lost)
	if total.Sockets != sockets || total.WrongSrc != 0 || total.Answered+total.WrongSrc+total.Lost != sockets {
		t.Errorf("want %d sockets and 0 wrong-source replies: %+v", sockets, total)
	}
	if total.Lost > sockets/100 {
		t.Errorf("%d of %d queries lost", total.Lost, sockets)
	}
	if got := hookCounter(t, n.pinDir(), "total", "map_miss"); got != 0 {
		t.Errorf("map_miss = %d", got)
	}
}

// With capture-all, one socket querying several uncaptured nameservers gets
// every reply from the nameserver it asked: each distinct destination takes its
// own capture-all slot. A socket that runs out of slots is left alone for the
// next destination (it reaches that nameserver itself) rather than ever getting
// a reply from the wrong source.
func TestCaptureAllOneSocketSeveralNameservers(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	cfg.CaptureAll = true
	n.start(t, cfg)
	var dsts []string
	for _, a := range others {
		dsts = append(dsts, hp(a, 53))
	}
	for _, fam := range []int{4, 6} {
		t.Run(fmt.Sprintf("AF_INET%s", map[int]string{4: "", 6: "6"}[fam]), func(t *testing.T) {
			before := hookCounter(t, n.pinDir(), "total", "skip_no_state")
			// ns1 (a listed slot) and five uncaptured nameservers on one socket:
			// ns1 and the first three others fill the socket's four entries.
			all := append([]string{hp(ns1, 53)}, dsts...)
			if fam == 6 {
				for i, d := range all {
					ap := netip.MustParseAddrPort(d)
					all[i] = hp(mapped(ap.Addr()), 53)
				}
			}
			rs := n.query(t, proc{uid: userUID}, "-mode=sendto", fmt.Sprintf("-family=%d", fam), "-dst="+strings.Join(all, ","))
			if len(rs) != len(all) {
				t.Fatalf("got %d results, want %d", len(rs), len(all))
			}
			wantCaptured(t, rs[0], 4, 0, all[0], "")
			for i := 1; i < len(all); i++ {
				r := rs[i]
				if r.Src != all[i] {
					t.Errorf("query to %s: reply from %s", all[i], r.Src)
				}
				if i <= sockEntries-1 {
					wantCaptured(t, r, 4, 3+i-1, all[i], "")
				} else {
					wantOriginal(t, r)
				}
			}
			if got := hookCounter(t, n.pinDir(), "total", "skip_no_state") - before; got != uint64(len(all)-sockEntries) {
				t.Errorf("skip_no_state went up by %d, want %d", got, len(all)-sockEntries)
			}
		})
	}
	if got := hookCounter(t, n.pinDir(), "total", "map_miss"); got != 0 {
		t.Errorf("map_miss = %d", got)
	}
}
