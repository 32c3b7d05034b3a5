package connload

import (
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	out := "FAIL 3 198.19.0.4 eperm\nFAIL 7 - eai:-3\nSUMMARY cycles=10 ok=8 eperm=1 failed=1 retrans=2 p50_us=40 p99_us=900 max_us=1200\nRUSAGE cpu_ns=5000000\n"
	s, err := Parse(out, 1)
	if err != nil {
		t.Fatal(err)
	}
	want := Summary{Cycles: 10, OK: 8, EPERM: 1, Failed: 1, Retrans: 2, P50: 40, P99: 900, Max: 1200, CPU: 5 * time.Millisecond,
		Fails: []string{"3 198.19.0.4 eperm"}, HasRusage: true}
	if s.Cycles != want.Cycles || s.OK != want.OK || s.EPERM != want.EPERM || s.Failed != want.Failed || s.Retrans != want.Retrans ||
		s.P50 != want.P50 || s.P99 != want.P99 || s.Max != want.Max || s.CPU != want.CPU || len(s.Fails) != 1 || s.Fails[0] != want.Fails[0] || !s.HasRusage {
		t.Errorf("Parse = %+v, want %+v", s, want)
	}
	if _, err := Parse("FAIL 1 - eai:-2\n", 5); err == nil {
		t.Error("output without SUMMARY: no error")
	}
}
