//go:build linux

package main

import (
	"strings"
	"testing"
)

// The warm lookup ratio pairs the two clients' runs of each round and takes the
// median over rounds: a slow stretch that hits one round's pair moves that round's
// ratio little, and an outlier round does not decide.
func TestLookupRatio(t *testing.T) {
	res := func(p50s ...float64) []lookupResult {
		var out []lookupResult
		for _, p := range p50s {
			out = append(out, lookupResult{P50US: p, MeanUS: p * 1.1})
		}
		return out
	}
	rep := lookupReport{rows: []lookupRow{
		// Round 2 ran while the machine was slow: both sides 1.5x.
		{rounds: res(60, 66, 90, 62, 140)},
		{rounds: res(240, 264, 360, 250, 250)},
	}}
	for i := range rep.rows {
		rep.rows[i].warm = *medianRun(rep.rows[i].rounds, func(x *lookupResult) float64 { return x.P50US })
	}
	p50s, means := rep.roundRatios()
	if med, mean := median(p50s), median(means); med != 0.25 || mean != 0.25 {
		t.Fatalf("ratio = %v, %v; want the median of 0.25, 0.25, 0.25, 0.248, 0.56 = 0.25", med, mean)
	}
	if got := rep.rows[0].warm.P50US; got != 66 {
		t.Fatalf("warm row = the round with p50 %v, want the median round (66)", got)
	}
	v := rep.verdict()
	if !strings.HasPrefix(v, "PASS (median 0.25x") || !strings.Contains(v, "0.25, 0.25, 0.25, 0.25, 0.56") {
		t.Fatalf("verdict %q", v)
	}
	rep.rows[1].err = "warm: boom"
	if v := rep.verdict(); v != "NOT MEASURED" {
		t.Fatalf("verdict with a failed client = %q", v)
	}
}
