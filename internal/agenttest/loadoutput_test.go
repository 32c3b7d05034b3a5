package agenttest

import (
	"reflect"
	"testing"
)

func TestParseLoadOutput(t *testing.T) {
	out := "START\n" +
		"FAIL 100 250 web.a.svc.cluster.local. timeout\n" +
		"FAIL 300 301 db.b.svc.cluster.local. nxdomain\n" +
		"FAIL short line\n" +
		"SUMMARY sent=10 ok=8 wrong=0 nxdomain=1 failed=1\n"
	got := ParseLoadOutput(out)
	want := LoadOutput{
		Fails: []LoadFail{
			{Start: 100, End: 250, Name: "web.a.svc.cluster.local.", What: "timeout"},
			{Start: 300, End: 301, Name: "db.b.svc.cluster.local.", What: "nxdomain"},
		},
		Summary: "sent=10 ok=8 wrong=0 nxdomain=1 failed=1",
		Counts:  map[string]int{"sent": 10, "ok": 8, "wrong": 0, "nxdomain": 1, "failed": 1},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("ParseLoadOutput:\n got %+v\nwant %+v", got, want)
	}
	if none := ParseLoadOutput("START\n"); none.Summary != "" || len(none.Fails) != 0 {
		t.Errorf("output without a summary: %+v", none)
	}
}
