package tap

import (
	"bytes"
	"encoding/json"
	"net/netip"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

func event(name string, qtype uint16, rcode int, a Answer, lat time.Duration) *Event {
	ev := &Event{Time: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC).UnixNano(), Latency: int64(lat),
		Key: workload.Key{Cgroup: 42, PID: 7, Addr: netip.MustParseAddr("10.1.2.3")}, Port: 5353,
		Qtype: qtype, Rcode: uint16(rcode), Answer: a, Size: 61}
	ev.SetName(name)
	return ev
}

// A subscriber gets what its filter selects, in order; a reader a whole ring
// behind loses the rest, counted; publishing without subscribers does nothing.
func TestHubFiltersAndCountsLost(t *testing.T) {
	h := NewHub(2, 4)
	if h.Active() {
		t.Fatal("active without subscribers")
	}
	h.Publish(event("a.example.", dns.TypeA, 0, Cache, 0)) // nobody listens
	all, err := h.Subscribe(Filter{})
	if err != nil {
		t.Fatal(err)
	}
	slow, err := h.Subscribe(Filter{Unanswered: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.Subscribe(Filter{}); err != ErrTooMany {
		t.Fatalf("third subscriber: %v, want ErrTooMany", err)
	}
	for i := range 6 {
		a := Upstream
		if i%2 == 1 {
			a = Failed
		}
		h.Publish(event("q.example.", dns.TypeA, dns.RcodeServerFailure, a, time.Duration(i)))
	}
	var ev Event
	var got []int64
	for all.Next(&ev) {
		got = append(got, ev.Latency)
	}
	if !reflect.DeepEqual(got, []int64{0, 1, 2, 3}) || all.TakeLost() != 2 || all.TakeLost() != 0 {
		t.Errorf("all: got %v (lost then %d), want the first 4 of 6 and 2 lost once", got, all.Lost())
	}
	got = nil
	for slow.Next(&ev) {
		got = append(got, ev.Latency)
	}
	if !reflect.DeepEqual(got, []int64{1, 3, 5}) || slow.TakeLost() != 0 {
		t.Errorf("unanswered: got %v, want the 3 failed ones, none lost", got)
	}
	all.Close()
	slow.Close()
	if h.Active() || h.Lost() != 2 {
		t.Errorf("after close: active %v, lost %d", h.Active(), h.Lost())
	}
}

func (s *Sub) Lost() uint64 { return s.r.lost.Load() }

// Many writers, one reader: every event arrives once or is counted lost.
func TestRingConcurrentWriters(t *testing.T) {
	r := newRing(64)
	const writers, each = 4, 5000
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				r.put(&Event{Time: int64(w*each + i)})
			}
		}()
	}
	seen := map[int64]bool{}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var ev Event
	for finished := false; ; {
		for r.get(&ev) {
			if seen[ev.Time] {
				t.Fatalf("event %d read twice", ev.Time)
			}
			seen[ev.Time] = true
		}
		if finished {
			break
		}
		select {
		case <-done:
			finished = true
		default:
		}
	}
	if n := uint64(len(seen)) + r.lost.Load(); n != writers*each {
		t.Errorf("read %d + lost %d = %d, want %d", len(seen), r.lost.Load(), n, writers*each)
	}
}

func TestFilterMatches(t *testing.T) {
	ev := event("api.team-a.svc.cluster.local.", dns.TypeAAAA, dns.RcodeNameError, Table, 3*time.Millisecond)
	id := workload.Identity{Workload: "team-a/web-1", Namespace: "team-a", Pod: "web-1", Cgroup: "/kubepods/podx/abc"}
	for _, tc := range []struct {
		q    string
		want bool
	}{
		{"", true},
		{"suffix=svc.cluster.local", true},
		{"suffix=cluster.local.", true},
		{"suffix=ter.local", false},
		{"qtype=A,AAAA", true},
		{"qtype=A", false},
		{"rcode=NXDOMAIN", true},
		{"rcode=NOERROR", false},
		{"answer=table", true},
		{"answer=cache&answer=upstream", false},
		{"min-latency=2ms", true},
		{"min-latency=5ms", false},
		{"unanswered=true", false},
		{"namespace=team-a&pod=web-*", true},
		{"namespace=team-b", false},
		{"cgroup=/kubepods", true},
		{"cgroup=/kubepods/*/abc", true},
		{"cgroup=/system.slice", false},
	} {
		v, _ := url.ParseQuery(tc.q)
		f, err := ParseFilter(v)
		if err != nil {
			t.Fatalf("%s: %v", tc.q, err)
		}
		if got := f.matchEvent(ev) && f.MatchIdentity(id); got != tc.want {
			t.Errorf("%q: match %v, want %v", tc.q, got, tc.want)
		}
		if back, err := ParseFilter(f.Values()); err != nil || !reflect.DeepEqual(back, f) {
			t.Errorf("%q: Values round trip gave %+v (%v), want %+v", tc.q, back, err, f)
		}
	}
	for _, bad := range []string{"qtype=BOGUS", "rcode=nope", "answer=magic", "min-latency=soon", "unanswered=maybe"} {
		v, _ := url.ParseQuery(bad)
		if _, err := ParseFilter(v); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// The hand-written JSON of a record decodes into Record with every field.
func TestRecordJSON(t *testing.T) {
	ev := event("www.example.com.", dns.TypeA, dns.RcodeSuccess, Upstream, 1234567*time.Nanosecond)
	ev.Upstream = netip.MustParseAddrPort("192.0.2.53:53")
	id := workload.Identity{Workload: "team-a/web-1", Namespace: "team-a", Pod: "web-1", Container: "app",
		Cgroup: "/kubepods/pod1/abc", CgroupID: 42, PID: 7, By: "cgroup"}
	b := appendRecord(nil, ev, appendIdentity(nil, &id))
	b = appendLost(b, 3)
	var got []Record
	if err := Read(bytes.NewReader(b), func(r *Record) error { got = append(got, *r); return nil }); err != nil {
		t.Fatal(err)
	}
	want := []Record{{Time: time.Unix(0, ev.Time).UTC(), Identity: id, Client: "10.1.2.3:5353", Proto: "udp",
		Qname: "www.example.com.", Qtype: "A", Rcode: "NOERROR", Answer: "upstream", Upstream: "192.0.2.53:53",
		LatencyUS: 1234.6, Size: 61}, {Lost: 3}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("decoded\n%+v\nwant\n%+v\nfrom %s", got, want, b)
	}
	var text bytes.Buffer
	if err := WriteText(&text, &got[0]); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s\n%s", TextHeader, text.String())
}

// A record stays valid JSON whatever bytes its name and its sender carry:
// DNS names may hold any byte, cgroup paths any UTF-8.
func TestRecordJSONEscapes(t *testing.T) {
	for _, name := range []string{"a\x01b.example.", "caf\xc3\xa9.example.", "bad\xff.example.", `q"uo\te.example.`} {
		ev := event(name, dns.TypeA, dns.RcodeSuccess, Cache, time.Millisecond)
		id := workload.Identity{Workload: "/system.slice/caf\u00e9 \"x\".service", Cgroup: "/system.slice/caf\u00e9 \"x\".service", By: "cgroup"}
		b := appendRecord(nil, ev, appendIdentity(nil, &id))
		var r Record
		if err := json.Unmarshal(b, &r); err != nil {
			t.Errorf("name %q: %v: %s", name, err, b)
			continue
		}
		if want := strings.ToValidUTF8(name, "\uFFFD"); r.Qname != want || r.Workload != id.Workload {
			t.Errorf("name %q: decoded qname %q workload %q, want %q, %q", name, r.Qname, r.Workload, want, id.Workload)
		}
	}
}

// Publishing with nobody subscribed allocates nothing and checks one pointer.
func TestPublishWithoutSubscribersAllocatesNothing(t *testing.T) {
	h := NewHub(0, 0)
	ev := event("a.example.", dns.TypeA, 0, Cache, 0)
	if n := testing.AllocsPerRun(1000, func() {
		if h.Active() {
			h.Publish(ev)
		}
	}); n != 0 {
		t.Errorf("%v allocations per publish", n)
	}
}

// An egress decision is a record of its own: the workload, the destination, the
// name it was answered for (if any) and the verdict, without a query's fields.
func TestEgressDecisionRecords(t *testing.T) {
	for _, tc := range []struct {
		a    Answer
		name string
	}{{Denied, "evil.example."}, {Audited, ""}} {
		ev := &Event{Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC).UnixNano(), Key: workload.Key{Cgroup: 42},
			Answer: tc.a, Dst: netip.MustParseAddrPort("198.18.0.7:443"), TCP: true}
		ev.SetName(tc.name)
		b := appendRecord(nil, ev, nil)
		var r Record
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatalf("%s: %v: %s", tc.a, err, b)
		}
		if r.Answer != tc.a.String() || r.Dst != "198.18.0.7:443" || r.Qname != tc.name || r.Qtype != "" || r.Rcode != "" || r.Proto != "tcp" {
			t.Errorf("%s: record %+v from %s", tc.a, r, b)
		}
		var text strings.Builder
		if err := WriteText(&text, &r); err != nil || !strings.Contains(text.String(), "198.18.0.7:443") {
			t.Errorf("%s: text %q (%v) lacks the destination", tc.a, text.String(), err)
		}
		f, err := ParseFilter(url.Values{"answer": {"denied,audited"}})
		if err != nil || !f.matchEvent(ev) {
			t.Errorf("%s: the --denied filter (%v) does not select it", tc.a, err)
		}
		if q := event("a.example.", dns.TypeA, 0, Cache, 0); f.matchEvent(q) {
			t.Errorf("the --denied filter selects a query")
		}
	}
}
