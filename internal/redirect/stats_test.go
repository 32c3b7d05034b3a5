package redirect

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"testing"
)

// Counters match the queries exactly, per hook, in total and per cgroup; the
// table and JSON carry them.
func TestStats(t *testing.T) {
	n := newTestNet(t)
	d := n.start(t, n.config())
	sendStatsQueries(t, n)
	s, err := ReadStats(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	checkHookCounters(t, s)
	mine := checkCgroupCounters(t, s, n.cg.Path)
	checkStatsTable(t, s, mine, n.cg.Path)
	checkStatsJSON(t, s, n.cg.Path)
	checkStatusOf(t, n, d)
}

// sendStatsQueries sends TestStats's queries and checks each went where it
// should.
func sendStatsQueries(t *testing.T, n *testNet) {
	t.Helper()
	check := func(rs []clientResult, want int) {
		t.Helper()
		if len(rs) != want {
			t.Fatalf("%d results, want %d", len(rs), want)
		}
		for _, r := range rs {
			wantCaptured(t, r, 4, 0, "", hp(ns1, 53))
		}
	}
	check(n.query(t, proc{uid: userUID}, "-mode=connect", "-dst="+hp(ns1, 53), fmt.Sprintf("-n=%d", nUDP)), nUDP)
	rs := n.query(t, proc{uid: userUID}, "-mode=sendto", "-dst="+hp(ns1, 53), fmt.Sprintf("-n=%d", nSendto))
	if len(rs) != nSendto {
		t.Fatalf("%d results", len(rs))
	}
	for _, r := range rs {
		wantCaptured(t, r, 4, 0, hp(ns1, 53), "")
	}
	check(n.query(t, proc{uid: userUID}, "-mode=tcp", "-dst="+hp(ns1, 53), fmt.Sprintf("-n=%d", nTCP)), nTCP)
	for _, r := range n.query(t, proc{uid: proxyUID}, "-mode=connect", "-dst="+hp(ns1, 53), fmt.Sprintf("-n=%d", nProxy)) {
		wantOriginal(t, r)
	}

}

// checkHookCounters checks the counters per hook and in total.
func checkHookCounters(t *testing.T, s *Stats) {
	t.Helper()
	want := map[[2]string]uint64{
		{"connect4", "redirected_udp"}:      nUDP,
		{"connect4", "redirected_tcp"}:      nTCP,
		{"connect4", "skip_proxy"}:          nProxy,
		{"sendmsg4", "redirected_udp"}:      nSendto,
		{"recvmsg4", "reply_rewritten"}:     nUDP + nSendto,
		{"getpeername4", "reply_rewritten"}: nUDP + nTCP,
		{"total", "redirected_udp"}:         nUDP + nSendto,
		{"total", "redirected_tcp"}:         nTCP,
		{"total", "reply_rewritten"}:        2*nUDP + nSendto + nTCP,
		{"total", "skip_proxy"}:             nProxy,
		{"total", "map_miss"}:               0,
		{"total", "skip_no_resolver"}:       0,
		{"total", "skip_stalled"}:           0,
		{"total", "skip_no_state"}:          0,
		{"connect6", "redirected_udp"}:      0,
	}
	for k, v := range want {
		if got := counterOf(t, s, k[0], k[1]); got != v {
			t.Errorf("%s %s = %d, want %d", k[0], k[1], got, v)
		}
	}

}

// checkCgroupCounters checks the test cgroup's counters and returns its row.
func checkCgroupCounters(t *testing.T, s *Stats, path string) *CgroupStats {
	t.Helper()
	var mine *CgroupStats
	for i := range s.Cgroups {
		if s.Cgroups[i].Path == path {
			mine = &s.Cgroups[i]
		}
	}
	if mine == nil {
		t.Fatalf("no per-cgroup stats for %s: %+v", path, s.Cgroups)
	}
	if mine.RedirectedUDP != nUDP+nSendto || mine.RedirectedTCP != nTCP || mine.Skipped != nProxy || mine.ReplyRewritten != 2*nUDP+nSendto+nTCP {
		t.Errorf("cgroup stats %+v, want udp %d tcp %d skipped %d rewritten %d", *mine, nUDP+nSendto, nTCP, nProxy, 2*nUDP+nSendto+nTCP)
	}
	if s.Cgroups[0].Path != path {
		t.Errorf("first cgroup row is %+v, want the test cgroup (most queries)", s.Cgroups[0])
	}

	return mine
}

// checkStatsTable checks the stats table: header, rows, alignment.
func checkStatsTable(t *testing.T, s *Stats, mine *CgroupStats, path string) {
	t.Helper()
	var buf bytes.Buffer
	if err := s.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	t.Logf("stats table:\n%s", out)
	lines := strings.Split(out, "\n")
	if f := strings.Fields(lines[0]); len(f) != 1+len(CounterNames()) || f[0] != "HOOK" || f[1] != "REDIRECTED_UDP" {
		t.Errorf("header %q", lines[0])
	}
	rowOf := func(name string) []string {
		for _, l := range lines {
			if f := strings.Fields(l); len(f) > 0 && f[0] == name {
				return f
			}
		}
		t.Fatalf("no %s row in table", name)
		return nil
	}
	if f := rowOf("connect4"); f[1] != fmt.Sprint(nUDP) || f[2] != fmt.Sprint(nTCP) {
		t.Errorf("connect4 row %v", f)
	}
	if f := rowOf("TOTAL"); f[1] != fmt.Sprint(nUDP+nSendto) || f[3] != fmt.Sprint(2*nUDP+nSendto+nTCP) {
		t.Errorf("TOTAL row %v", f)
	}
	if f := rowOf(fmt.Sprint(mine.ID)); f[1] != path || f[2] != fmt.Sprint(nUDP+nSendto) {
		t.Errorf("cgroup row %v", f)
	}
	if !strings.Contains(out, "CGROUP ID") || !strings.Contains(out, "PATH") {
		t.Errorf("no per-cgroup header in table")
	}
	// Columns are aligned: the counters of every row start where the header's do.
	hdrCol := strings.Index(lines[0], "REDIRECTED_UDP")
	for _, l := range lines[1 : 1+len(hooks)+1] {
		if len(l) <= hdrCol || l[hdrCol-1] != ' ' || l[hdrCol] == ' ' {
			t.Errorf("row %q not aligned with header column at %d", l, hdrCol)
		}
	}

}

// checkStatsJSON checks the stats' JSON.
func checkStatsJSON(t *testing.T, s *Stats, path string) {
	t.Helper()
	js, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	var generic map[string]any
	if err := json.Unmarshal(js, &generic); err != nil {
		t.Fatal(err)
	}
	total := generic["total"].(map[string]any)
	if total["redirected_udp"].(float64) != nUDP+nSendto || total["reply_rewritten"].(float64) != 2*nUDP+nSendto+nTCP {
		t.Errorf("JSON total %v", total)
	}
	if len(generic["hooks"].([]any)) != len(hooks) {
		t.Errorf("JSON hooks: %v", generic["hooks"])
	}
	cg0 := generic["cgroups"].([]any)[0].(map[string]any)
	if cg0["path"] != path || cg0["redirected_tcp"].(float64) != nTCP {
		t.Errorf("JSON cgroup %v", cg0)
	}

}

// checkStatusOf checks the datapath status: capturing, targets,
// nameservers, exemptions and programs.
func checkStatusOf(t *testing.T, n *testNet, d *Datapath) {
	t.Helper()
	st, err := ReadStatus(n.pinDir())
	if err != nil {
		t.Fatal(err)
	}
	if !st.Capturing || st.Stalled || st.ResolverSockets != 2*2*testSlots-2*2*maxAllSlots || st.Dequeued == 0 {
		t.Errorf("status capturing=%v stalled=%v resolver sockets=%d dequeued=%d, want capturing, %d sockets",
			st.Capturing, st.Stalled, st.ResolverSockets, st.Dequeued, 2*2*(testSlots-maxAllSlots))
	}
	if st.Target4 != netip.AddrPortFrom(target4, testBasePort) || st.Target6 != netip.AddrPortFrom(target6, testBasePort) {
		t.Errorf("status targets %v %v", st.Target4, st.Target6)
	}
	if len(st.Nameservers) != 3 || st.Nameservers[2].Address != ns6 || st.Nameservers[2].Port != testBasePort+2 {
		t.Errorf("status nameservers %+v", st.Nameservers)
	}
	if len(st.ProxyUIDs) != 1 || st.ProxyUIDs[0] != proxyUID || st.UpstreamMark != testMark {
		t.Errorf("status uids %v mark %#x", st.ProxyUIDs, st.UpstreamMark)
	}
	progs := d.Programs()
	if len(st.Programs) != len(hooks) {
		t.Fatalf("status lists %d programs, want %d", len(st.Programs), len(hooks))
	}
	for i, p := range st.Programs {
		if p.Cgroup != n.cg.Path || p.ProgramID == 0 || p.LinkID == 0 || p != progs[i] {
			t.Errorf("status program %+v, Programs() %+v", p, progs[i])
		}
	}
	var buf bytes.Buffer
	if err := st.WriteText(&buf); err != nil {
		t.Fatal(err)
	}
	t.Logf("status:\n%s", buf.String())
}
