// Package connload reads the report of the resolve -> connect clients
// (test/e2e/testdata/egressload, the C library's clients, and
// test/e2e/testdata/goegress), which the egress end-to-end tests and the egress
// bench lane run: one FAIL line per cycle that did not connect and a SUMMARY
// line of key=value counts (and, from the bench's rusage wrapper, a RUSAGE line).
package connload

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Summary is one client run's report.
type Summary struct {
	Cycles, OK, EPERM, Failed int
	Retrans                   int           // SYN retransmits (TCP_INFO; 0 from Go)
	P50, P99, Max             int           // µs from the answer to the connect, of the connects that went through
	CPU                       time.Duration // the client's CPU (RUSAGE cpu_ns; 0 without)
	Fails                     []string      // the FAIL lines, without "FAIL ", at most the maxFails given to Parse
	HasRusage                 bool          // a RUSAGE line was read
}

var field = regexp.MustCompile(`(\w+)=(\d+)`)

// Parse reads out. It fails when out has no SUMMARY line.
func Parse(out string, maxFails int) (Summary, error) {
	var s Summary
	summary := false
	for line := range strings.SplitSeq(out, "\n") {
		switch {
		case strings.HasPrefix(line, "FAIL "):
			if len(s.Fails) < maxFails {
				s.Fails = append(s.Fails, strings.TrimPrefix(line, "FAIL "))
			}
		case strings.HasPrefix(line, "SUMMARY "), strings.HasPrefix(line, "RUSAGE "):
			summary = summary || strings.HasPrefix(line, "SUMMARY ")
			s.HasRusage = s.HasRusage || strings.HasPrefix(line, "RUSAGE ")
			for _, m := range field.FindAllStringSubmatch(line, -1) {
				s.set(m[1], m[2])
			}
		}
	}
	if !summary {
		return s, fmt.Errorf("no SUMMARY line in the client's output:\n%s", out)
	}
	return s, nil
}

func (s *Summary) set(k, v string) {
	n, _ := strconv.Atoi(v)
	switch k {
	case "cycles":
		s.Cycles = n
	case "ok":
		s.OK = n
	case "eperm":
		s.EPERM = n
	case "failed":
		s.Failed = n
	case "retrans":
		s.Retrans = n
	case "p50_us":
		s.P50 = n
	case "p99_us":
		s.P99 = n
	case "max_us":
		s.Max = n
	case "cpu_ns":
		s.CPU = time.Duration(n)
	}
}
