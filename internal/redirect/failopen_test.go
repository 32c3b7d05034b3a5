package redirect

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// Capture needs a registered resolver socket: before Serve, after Unserve and
// as soon as the resolver's sockets are closed (the kernel drops a closed
// socket from resolver_socks) queries go to the original nameserver, with no
// window in which they are refused or lost.
func TestFailOpenWithoutResolverSockets(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	cfg.Detach = true
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	n.startDatapath(t, d)
	t.Cleanup(func() { d.Close() })
	q := func() clientResult { return n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0] }

	wantOriginal(t, q())
	if got := hookCounter(t, n.pinDir(), "connect4", "skip_no_resolver"); got != 1 {
		t.Errorf("skip_no_resolver = %d before Serve, want 1", got)
	}
	n.serve(t, d, cfg)
	wantCaptured(t, q(), 4, 0, hp(ns1, 53), hp(ns1, 53))
	if err := d.Unserve(); err != nil {
		t.Fatal(err)
	}
	wantOriginal(t, q())
	n.serve(t, d, cfg)
	wantCaptured(t, q(), 4, 0, hp(ns1, 53), hp(ns1, 53))

	// The slot-0 resolver goes away (its sockets are closed): the very next
	// query goes to the original nameserver; slot 1 is still captured.
	n.resolvers[0].Close()
	wantOriginal(t, q())
	wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns2, 53))[0], 4, 1, hp(ns2, 53), hp(ns2, 53))
	if got := hookCounter(t, n.pinDir(), "connect4", "skip_no_resolver"); got != 3 {
		t.Errorf("skip_no_resolver = %d, want 3", got)
	}
}

// A resolver that stops dequeuing (frozen: its sockets stay open and queries
// queue up) is bypassed once nothing was dequeued for the stall timeout after a
// redirect; one that is slow but still dequeues is never bypassed, nor is an
// idle one after a redirect that never sent anything (the watchdog probes it);
// and capture resumes as soon as a frozen resolver dequeues again.
func TestStallDetection(t *testing.T) {
	n := newTestNet(t)
	n.start(t, n.config())
	t.Run("idle resolver, connect without send", func(t *testing.T) { idleResolverIsNotBypassed(t, n) })
	t.Run("slow resolver that still dequeues", func(t *testing.T) { slowResolverIsNotBypassed(t, n) })
	t.Run("frozen resolver", func(t *testing.T) { frozenResolverIsBypassedUntilItThaws(t, n) })
}

// idleResolverIsNotBypassed: after a connect that sent nothing, the
// watchdog's probe keeps an idle resolver's watch fresh, and a query well
// past the stall timeout is captured.
func idleResolverIsNotBypassed(t *testing.T, n *testNet) {
	stall := DefaultStallAfter
	before := readStatus(t, n).Dequeued
	rs := n.query(t, proc{uid: userUID}, "-mode=connect", "-nosend", "-dst="+hp(ns1, 53))
	connected := rs[0].TConn
	// The watchdog's probe is dequeued before the watch goes stale.
	if !testenv.WaitFor(2*time.Second, func() bool { return readStatus(t, n).Dequeued > before }) {
		t.Fatalf("the watchdog never probed the resolver")
	}
	// Well past the stall timeout since the connect, a query is captured.
	for time.Duration(monotonicNow()-connected) < 2*stall {
		time.Sleep(stall / 4)
	}
	wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0], 4, 0, hp(ns1, 53), hp(ns1, 53))
	if got := hookCounter(t, n.pinDir(), "total", "skip_stalled"); got != 0 {
		t.Errorf("skip_stalled = %d for an idle resolver", got)
	}
}

// slowResolverIsNotBypassed: a resolver slower than most of the stall
// timeout, that still dequeues, gets every query.
func slowResolverIsNotBypassed(t *testing.T, n *testNet) {
	slot0, stall := n.resolvers[0], DefaultStallAfter
	slot0.SetReadDelay(stall * 6 / 10)
	defer slot0.SetReadDelay(0)
	var wg sync.WaitGroup
	results := make([][]clientResult, 4)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = n.query(t, proc{uid: userUID}, "-mode=loop", "-dst="+hp(ns1, 53), "-dur=1500ms", "-timeout=5s")
		}()
	}
	wg.Wait()
	total := 0
	for _, rs := range results {
		for _, r := range rs {
			total++
			if !isCaptured(r) {
				t.Errorf("query through a slow resolver was not captured: %+v", r)
			}
		}
	}
	t.Logf("slow resolver (read delay %v, stall timeout %v): %d queries, all captured", stall*6/10, stall, total)
	if got := hookCounter(t, n.pinDir(), "total", "skip_stalled"); got != 0 {
		t.Errorf("skip_stalled = %d for a resolver that dequeues every %v", got, stall*6/10)
	}
}

// frozenResolverIsBypassedUntilItThaws: queries go to their original
// nameserver within the stall timeout of a freeze, and to the resolver again
// once it dequeues.
func frozenResolverIsBypassedUntilItThaws(t *testing.T, n *testNet) {
	slot0 := n.resolvers[0]
	for _, r := range n.resolvers {
		r.SetReadDelay(0)
	}
	thaw := slot0.Freeze()
	defer thaw()
	frozen := monotonicNow()
	// A query every 50 ms at most: the programs confirm a stall with a second
	// look stall/4 after the first one past the timeout (a sparser client
	// sends one more query to the frozen resolver).
	rs := n.query(t, proc{uid: userUID}, "-mode=loop", "-dst="+hp(ns1, 53), "-dur=1s", "-timeout=50ms")
	var lastToResolver, firstOriginal time.Duration = -1, -1
	lost := 0
	for _, r := range rs {
		at := time.Duration(r.TConn - frozen)
		switch {
		case r.Err != "" || isCaptured(r):
			// In flight: sent to the resolver before the stall was detected (a
			// read already waiting in the kernel may still answer one).
			if r.Err != "" {
				lost++
			}
			lastToResolver = at
			if at > 250*time.Millisecond {
				t.Errorf("query connected %v after the freeze still went to the frozen resolver (%+v)", at, r)
			}
		default:
			wantOriginal(t, r)
			if firstOriginal < 0 {
				firstOriginal = at
			}
		}
	}
	t.Logf("frozen resolver: %d queries; %d lost in flight, the last to the resolver connected %v after the freeze; first to the original %v after it",
		len(rs), lost, lastToResolver, firstOriginal)
	if firstOriginal < 0 || firstOriginal > 250*time.Millisecond+100*time.Millisecond {
		t.Errorf("first query to the original nameserver %v after the freeze, want within 250ms (and one more query)", firstOriginal)
	}
	if got := hookCounter(t, n.pinDir(), "total", "skip_stalled"); got == 0 {
		t.Errorf("skip_stalled = 0")
	}
	st := readStatus(t, n)
	if !st.Stalled || st.Capturing {
		t.Errorf("status of a frozen resolver: stalled=%v capturing=%v", st.Stalled, st.Capturing)
	}
	// It thaws and dequeues its backlog: capture resumes.
	thaw()
	if !testenv.WaitFor(2*time.Second, func() bool {
		return isCaptured(n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53), "-timeout=300ms")[0])
	}) {
		t.Errorf("capture did not resume after the resolver thawed")
	}
}

// A resolver that freezes while nothing is being redirected to it is bypassed
// by the first query that comes 250 ms or more later: the stall timeout runs
// from the resolver's last dequeue, not from the first query it leaves unread,
// so a sparse client loses no lookup to it. Also when it never got a query
// before it froze.
func TestStallDetectedBeforeSparseQuery(t *testing.T) {
	for _, warm := range []bool{true, false} {
		name := "after a query"
		if !warm {
			name = "no query before"
		}
		t.Run(name, func(t *testing.T) {
			n := newTestNet(t)
			n.start(t, n.config())
			if !testenv.WaitFor(time.Second, func() bool { return readStatus(t, n).WatchClock }) {
				testenv.Skip(t, "no watch clock: the kernel has no BPF timers (Linux 5.15)")
			}
			slot0 := n.resolvers[0]
			if warm {
				wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0], 4, 0, hp(ns1, 53), hp(ns1, 53))
			}
			thaw, frozen := freezeNow(t, n, slot0)
			defer thaw()
			// The spec's point: lookups started 250 ms after the freeze.
			time.Sleep(time.Duration(frozen + uint64(250*time.Millisecond) - monotonicNow()))
			r := n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53), "-timeout=1s")[0]
			t.Logf("query connected %v after the freeze: %+v", time.Duration(r.TConn-frozen).Round(time.Millisecond), r)
			wantOriginal(t, r)
			if got := hookCounter(t, n.pinDir(), "total", "skip_stalled"); got == 0 {
				t.Errorf("skip_stalled = 0")
			}
		})
	}
}

// freezeNow freezes r the way SIGSTOP freezes a resolver: the read its
// reader is blocked in takes one empty datagram (the fake resolver would
// otherwise still answer the next query), and from then on nothing is read.
// It returns the thaw function and the time of the last read.
func freezeNow(t *testing.T, n *testNet, r *testenv.FakeDNS) (func(), uint64) {
	t.Helper()
	thaw := r.Freeze()
	before := readStatus(t, n).Dequeued
	err := n.node.Do(func() error {
		c, err := net.Dial("udp", r.Addr)
		if err != nil {
			return err
		}
		defer c.Close()
		_, err = c.Write(nil)
		return err
	})
	if err != nil {
		thaw()
		t.Fatalf("send the last datagram before the freeze: %v", err)
	}
	if !testenv.WaitFor(2*time.Second, func() bool { return readStatus(t, n).Dequeued > before }) {
		thaw()
		t.Fatalf("the resolver did not read its last datagram before the freeze")
	}
	return thaw, monotonicNow()
}

func readStatus(t *testing.T, n *testNet) *Status {
	t.Helper()
	st, err := ReadStatus(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	return st
}

const agentEnv = "MESHDNS_REDIRECT_AGENT"

// agentTarget is the stand-in agent's own resolver address: a port the test's
// fake resolvers do not use.
var agentTarget = netip.AddrPortFrom(target4, 5400)

const agentAnswer = "10.54.0.0"

// runAgent is a stand-in agent for the kill -9 test: in the node namespace (the
// path in MESHDNS_REDIRECT_NETNS) it serves mesh.test on agentTarget, starts the
// datapath for the JSON config, registers its sockets, prints READY and waits
// to be killed.
func runAgent(cfgJSON string) int {
	var cfg Config
	if err := json.Unmarshal([]byte(cfgJSON), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	d, err := New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var udp net.PacketConn
	var tcp net.Listener
	err = testenv.DoInNetns(os.Getenv("MESHDNS_REDIRECT_NETNS"), func() (err error) {
		if err := d.Start(context.Background()); err != nil {
			return err
		}
		if udp, err = net.ListenPacket("udp", agentTarget.String()); err != nil {
			return err
		}
		var lc net.ListenConfig
		lc.SetMultipathTCP(false)
		tcp, err = lc.Listen(context.Background(), "tcp", agentTarget.String())
		return err
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(req)
		m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: req.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 5},
			A: net.ParseIP(agentAnswer)})
		_ = w.WriteMsg(m)
	})
	// Every datagram read counts as the resolver's progress, as the real
	// resolver counts it: also the watchdog's empty liveness probes, which
	// miekg/dns hands to MsgInvalidFunc, not MsgAcceptFunc (uncounted, an
	// idle stand-in looked stalled 200 ms after the watch clock's first look,
	// and a client slower than that was not captured).
	go (&dns.Server{PacketConn: udp, Handler: handler, MsgAcceptFunc: func(dns.Header) dns.MsgAcceptAction {
		d.Dequeued(1)
		return dns.MsgAccept
	}, MsgInvalidFunc: func([]byte, error) { d.Dequeued(1) }}).ActivateAndServe()
	go (&dns.Server{Listener: tcp, Handler: handler}).ActivateAndServe()
	if err := d.Serve([]Socket{{Addr: agentTarget, Conn: udp.(*net.UDPConn)}, {Addr: agentTarget, TCP: true, Conn: tcp.(*net.TCPListener)}}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("READY")
	select {}
}

func agentConfig(n *testNet) Config {
	cfg := n.config()
	cfg.Target4, cfg.Target6 = agentTarget, netip.AddrPort{}
	cfg.Nameservers = []netip.Addr{ns1}
	return cfg
}

// An agent killed with SIGKILL leaves its programs attached and pinned, but its
// resolver sockets close with it, so the very first query after its death goes
// to the original nameserver; Cleanup removes the leftovers.
func TestKilledAgentFailsOpenAndCleanup(t *testing.T) {
	n := newTestNet(t)
	cfgJSON, err := json.Marshal(agentConfig(n))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	agent := exec.CommandContext(ctx, clientBin)
	agent.Env = append(os.Environ(), agentEnv+"="+string(cfgJSON), "MESHDNS_REDIRECT_NETNS="+n.node.Path())
	agent.Stderr = os.Stderr
	stdout, err := agent.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = agent.Process.Kill()
		_ = agent.Wait()
		_, _ = Cleanup(n.pinDir())
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "READY" {
		t.Fatalf("agent did not get ready: %q %v", line, err)
	}
	// Idle, the agent is probed by its own watchdog; those probes are its
	// progress, so it is not taken for stalled however late the client is.
	if !testenv.WaitFor(5*time.Second, func() bool { return readStatus(t, n).Dequeued > 0 }) {
		t.Fatalf("the idle agent read none of its liveness probes: %+v", readStatus(t, n))
	}
	if st := readStatus(t, n); st.Stalled {
		t.Fatalf("the idle agent is taken for stalled: %+v", st)
	}
	r := n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0]
	if r.Err != "" || len(r.A) != 1 || r.A[0] != agentAnswer || r.Src != hp(ns1, 53) {
		t.Fatalf("query through the agent: %+v, want %s from %s", r, agentAnswer, hp(ns1, 53))
	}

	if err := agent.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = agent.Wait()
	if got := attachedPrograms(t, n.cg); got != len(hooks) {
		t.Fatalf("%d programs attached after kill -9, want %d (pinned links keep them)", got, len(hooks))
	}
	for i, r := range n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53), "-n=20", "-timeout=1s") {
		if r.Err != "" {
			t.Errorf("query %d after kill -9: %s (refused or lost)", i, r.Err)
			continue
		}
		wantOriginal(t, r)
	}
	if st, err := ReadStatus(n.pinDir()); err != nil {
		t.Errorf("ReadStatus of the leftovers: %v", err)
	} else if st.Capturing || st.ResolverSockets != 0 || len(st.Programs) != len(hooks) {
		t.Errorf("status of the leftovers: capturing=%v resolver sockets=%d programs=%d, want not capturing, 0, %d",
			st.Capturing, st.ResolverSockets, len(st.Programs), len(hooks))
	}

	removed, err := Cleanup(n.pinDir())
	if err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if want := len(hooks) + len(new(Datapath).mapsByName()); len(removed) != want {
		t.Errorf("Cleanup removed %d pins, want %d: %v", len(removed), want, removed)
	}
	if got := attachedPrograms(t, n.cg); got != 0 {
		t.Errorf("%d programs attached after Cleanup", got)
	}
	if pins := pinsUnder(t, n.bpffs); len(pins) != 0 {
		t.Errorf("pins left after Cleanup: %v", pins)
	}
	if removed, err := Cleanup(n.pinDir()); err != nil || len(removed) != 0 {
		t.Errorf("second Cleanup: %v %v, want nothing to do", removed, err)
	}
}

// A clean Close leaves the programs attached and pinned but inert; the next
// Start adopts the pinned links (same links, new programs: no moment without a
// program), keeps the counters, and removes what an older version pinned that
// this one does not use.
func TestStartAdoptsPinnedLinks(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	d1, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	n.startDatapath(t, d1)
	n.serve(t, d1, cfg)
	wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0], 4, 0, hp(ns1, 53), "")
	progs1 := d1.Programs()
	n.progressTo(nil)
	if err := d1.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if got := attachedPrograms(t, n.cg); got != len(hooks) {
		t.Fatalf("%d programs attached after Close, want %d", got, len(hooks))
	}
	wantOriginal(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0])

	// What an older version left: a sock_create link and an orig_dst map.
	old := passProgram(t, ebpf.CGroupSock, ebpf.AttachCGroupInetSockCreate)
	oldLink, err := link.AttachRawLink(link.RawLinkOptions{Target: n.cg.FD(), Program: old, Attach: ebpf.AttachCGroupInetSockCreate})
	if err != nil {
		t.Fatal(err)
	}
	if err := oldLink.Pin(n.pinDir() + "/links/sock_create"); err != nil {
		t.Fatal(err)
	}
	oldLink.Close()
	oldMap, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 16, ValueSize: 24, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := oldMap.Pin(n.pinDir() + "/maps/orig_dst"); err != nil {
		t.Fatal(err)
	}
	oldMap.Close()

	cfg.Detach = true
	d2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	n.startDatapath(t, d2)
	t.Cleanup(func() { d2.Close() })
	progs2 := d2.Programs()
	for i := range progs1 {
		if progs2[i].LinkID != progs1[i].LinkID || progs2[i].ProgramID == progs1[i].ProgramID {
			t.Errorf("%s: link %d program %d after restart, was link %d program %d: want the same link with a new program",
				progs1[i].Hook, progs2[i].LinkID, progs2[i].ProgramID, progs1[i].LinkID, progs1[i].ProgramID)
		}
	}
	if got := attachedPrograms(t, n.cg); got != len(hooks) {
		t.Errorf("%d programs attached after adoption, want %d", got, len(hooks))
	}
	res, err := link.QueryPrograms(link.QueryOptions{Target: n.cg.FD(), Attach: ebpf.AttachCGroupInetSockCreate})
	if err != nil || len(res.Programs) != 0 {
		t.Errorf("the older version's sock_create program is still attached (%v)", err)
	}
	for _, p := range pinsUnder(t, n.bpffs) {
		if strings.HasSuffix(p, "/sock_create") || strings.HasSuffix(p, "/orig_dst") {
			t.Errorf("older version's pin %s left", p)
		}
	}
	n.serve(t, d2, cfg)
	wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0], 4, 0, hp(ns1, 53), "")
	if got := hookCounter(t, n.pinDir(), "connect4", "redirected_udp"); got != 2 {
		t.Errorf("connect4 redirected_udp = %d after one query per agent, want 2 (counters carry over)", got)
	}
	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}
	if got := attachedPrograms(t, n.cg); got != 0 {
		t.Errorf("%d programs attached after Close with Detach", got)
	}
	if pins := pinsUnder(t, n.bpffs); len(pins) != 0 {
		t.Errorf("pins left after Close with Detach: %v", pins)
	}
}

// A restart keeps the per-socket state: a socket connected (redirected) before
// the restart still gets its replies restored after it. (A query it sends while
// no resolver runs reaches the resolver's address, where nothing listens: a
// connected socket cannot be steered back; see docs/design.md.)
func TestRestartKeepsSocketState(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	startAgent := func(detach bool) *Datapath {
		c := cfg
		c.Detach = detach
		d, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		n.startDatapath(t, d)
		n.serve(t, d, c)
		return d
	}
	d1 := startAgent(false)
	closed1 := false
	t.Cleanup(func() {
		if !closed1 {
			d1.Close()
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := n.clientCmd(ctx, proc{uid: userUID}, "-mode=connect", "-dst="+hp(ns1, 53), "-hold", "-again")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	sc := bufio.NewScanner(stdout)
	untilHold := func() []clientResult {
		var out []byte
		for sc.Scan() && sc.Text() != "HOLD" {
			out = append(out, sc.Text()+"\n"...)
		}
		return parseResults(t, out)
	}
	rs := untilHold()
	if len(rs) != 1 {
		t.Fatalf("got %d results before the restart", len(rs))
	}
	wantCaptured(t, rs[0], 4, 0, hp(ns1, 53), hp(ns1, 53))

	n.progressTo(nil)
	if err := d1.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	closed1 = true
	d2 := startAgent(true)
	t.Cleanup(func() {
		n.progressTo(nil)
		if err := d2.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	if _, err := stdin.Write([]byte("again\n")); err != nil {
		t.Fatal(err)
	}
	rs = untilHold()
	if len(rs) != 1 {
		t.Fatalf("got %d results after the restart", len(rs))
	}
	// Same socket, still connected to the resolver: the reply source must still
	// be restored from the state recorded under the first agent.
	wantCaptured(t, rs[0], 4, 0, hp(ns1, 53), "")
	s, err := ReadStats(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[[2]string]uint64{
		{"connect4", "redirected_udp"}:  1,
		{"recvmsg4", "reply_rewritten"}: 2,
		{"total", "map_miss"}:           0,
	} {
		if got := counterOf(t, s, k[0], k[1]); got != v {
			t.Errorf("%s %s = %d, want %d (counters carry over the restart)", k[0], k[1], got, v)
		}
	}
}

// Load does the slow part of a start (the verifier) while another agent
// serves, and changes nothing it sees: its links keep its programs, its
// queries are still captured, no pin changes, and a Close after Load alone
// leaves all of it so. A map pinned anew between Load and Start (another agent
// replaced it) is the one Start's programs use.
func TestLoadChangesNothingUntilStart(t *testing.T) {
	n := newTestNet(t)
	cfg := n.config()
	running := n.start(t, cfg)
	progs := running.Programs()
	pins := pinsUnder(t, n.bpffs)
	load := func() *Datapath {
		t.Helper()
		d, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.node.Do(func() error { return d.Load(t.Context()) }); err != nil {
			t.Fatalf("Load: %v", err)
		}
		return d
	}
	unchanged := func(when string) {
		t.Helper()
		if got := running.Programs(); fmt.Sprint(got) != fmt.Sprint(progs) {
			t.Errorf("%s: attached programs %v, were %v", when, got, progs)
		}
		if got := pinsUnder(t, n.bpffs); fmt.Sprint(got) != fmt.Sprint(pins) {
			t.Errorf("%s: pins %v, were %v", when, got, pins)
		}
		wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0], 4, 0, hp(ns1, 53), "")
	}

	loadedOnly := load()
	unchanged("after Load")
	if err := loadedOnly.Close(); err != nil {
		t.Fatalf("Close after Load: %v", err)
	}
	unchanged("after Close of a datapath only loaded")
	if err := loadedOnly.Start(t.Context()); err == nil {
		t.Errorf("Start after Close succeeded")
	}

	cfg.Detach = true // the last one leaves nothing
	next := load()
	// Another agent pins a fresh nameservers map after our Load.
	spec, err := loadRedirect()
	if err != nil {
		t.Fatal(err)
	}
	fresh, err := ebpf.NewMap(spec.Maps["nameservers"])
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	pin := filepath.Join(n.pinDir(), mapsDir, "nameservers")
	if err := os.Remove(pin); err != nil {
		t.Fatal(err)
	}
	if err := fresh.Pin(pin); err != nil {
		t.Fatal(err)
	}
	running.Handoff() // as a handover does: next takes over its sockets
	n.progressTo(nil)
	n.startDatapath(t, next)
	t.Cleanup(func() {
		if err := next.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	n.serve(t, next, cfg)
	want, _ := fresh.Info()
	got, _ := next.objs.Nameservers.Info()
	wantID, _ := want.ID()
	gotID, _ := got.ID()
	if gotID != wantID {
		t.Errorf("Start's programs use nameservers map %d, the pinned one is %d", gotID, wantID)
	}
	wantCaptured(t, n.query(t, proc{uid: userUID}, "-dst="+hp(ns1, 53))[0], 4, 0, hp(ns1, 53), "")
}
