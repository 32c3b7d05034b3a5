package agenttest

import (
	"bufio"
	"strconv"
	"strings"
)

// LoadOutput is what a load client (test/e2e/testdata/goload) printed: a
// FAIL line per failed lookup, then one SUMMARY line of key=value counts.
type LoadOutput struct {
	Fails   []LoadFail
	Summary string         // the SUMMARY line's fields; "" when it printed none
	Counts  map[string]int // the SUMMARY line's counts by key (sent, ok, wrong, ...)
}

// LoadFail is one FAIL line: a lookup of Name started and ended at the
// CLOCK_MONOTONIC times Start and End (ns), and what went wrong.
type LoadFail struct {
	Start, End int64
	Name, What string
}

// ParseLoadOutput reads a load client's output.
func ParseLoadOutput(out string) LoadOutput {
	o := LoadOutput{Counts: map[string]int{}}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 5 && f[0] == "FAIL":
			start, _ := strconv.ParseInt(f[1], 10, 64)
			end, _ := strconv.ParseInt(f[2], 10, 64)
			o.Fails = append(o.Fails, LoadFail{Start: start, End: end, Name: f[3], What: f[4]})
		case len(f) > 0 && f[0] == "SUMMARY":
			o.Summary = strings.Join(f[1:], " ")
			for _, kv := range f[1:] {
				k, v, _ := strings.Cut(kv, "=")
				o.Counts[k], _ = strconv.Atoi(v)
			}
		}
	}
	return o
}
