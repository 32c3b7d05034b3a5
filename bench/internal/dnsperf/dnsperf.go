// Package dnsperf runs the dnsperf load generator and parses its report: the
// summary statistics and, in verbose mode, the per-query latencies from which it
// computes percentiles (dnsperf itself only prints mean and stddev).
package dnsperf

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
)

// Result is one dnsperf run.
type Result struct {
	Version               string // "2.10.0"
	Sent, Completed, Lost uint64
	RunTime               float64 // seconds
	QPS                   float64
	Rcodes                map[string]uint64
	AvgLatency            float64 // seconds
	// Latencies holds the per-query latencies in seconds (verbose runs only),
	// sorted ascending.
	Latencies []float64
	// VerboseRcodes counts rcodes from the verbose lines, "T" for timeouts.
	VerboseRcodes map[string]uint64
}

// Parse reads dnsperf's output (stdout; verbose lines "> RCODE name type latency").
func Parse(r io.Reader) (Result, error) {
	res := Result{Rcodes: map[string]uint64{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	sawStats := false
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "> ") {
			f := strings.Fields(line[2:])
			if res.VerboseRcodes == nil {
				res.VerboseRcodes = map[string]uint64{}
			}
			if len(f) == 0 {
				continue
			}
			res.VerboseRcodes[f[0]]++
			if len(f) >= 4 {
				if lat, err := strconv.ParseFloat(f[len(f)-1], 64); err == nil {
					res.Latencies = append(res.Latencies, lat)
				}
			}
			continue
		}
		if v, ok := strings.CutPrefix(line, "Version "); ok && res.Version == "" {
			res.Version = strings.TrimSpace(v)
			continue
		}
		key, val, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok {
			continue
		}
		val = strings.TrimSpace(val)
		var err error
		switch key {
		case "Statistics":
			sawStats = true
		case "Queries sent":
			res.Sent, err = firstUint(val)
		case "Queries completed":
			res.Completed, err = firstUint(val)
		case "Queries lost":
			res.Lost, err = firstUint(val)
		case "Run time (s)":
			res.RunTime, err = firstFloat(val)
		case "Queries per second":
			res.QPS, err = firstFloat(val)
		case "Average Latency (s)":
			res.AvgLatency, err = firstFloat(val)
		case "Response codes":
			// "NOERROR 19713 (66.67%), NXDOMAIN 9856 (33.33%)"
			for part := range strings.SplitSeq(val, ",") {
				f := strings.Fields(part)
				if len(f) >= 2 {
					n, perr := strconv.ParseUint(f[1], 10, 64)
					if perr != nil {
						err = perr
						break
					}
					res.Rcodes[f[0]] = n
				}
			}
		}
		if err != nil {
			return res, fmt.Errorf("parse dnsperf %q: %w", line, err)
		}
	}
	if err := sc.Err(); err != nil {
		return res, fmt.Errorf("read dnsperf output: %w", err)
	}
	if !sawStats {
		return res, fmt.Errorf("no statistics in dnsperf output")
	}
	slices.Sort(res.Latencies)
	return res, nil
}

// Percentile returns the q-quantile (q from 0 to 1, nearest rank: 0.99 is
// the p99) of the verbose latencies in seconds, the same scale as
// internal/dnsfake's Probe.Percentile; NaN without samples or for q
// outside [0, 1] (a p99 written as 99 shows as NaN, not as the maximum).
func (r Result) Percentile(q float64) float64 {
	n := len(r.Latencies)
	if n == 0 || q < 0 || q > 1 {
		return math.NaN()
	}
	rank := int(math.Ceil(q * float64(n)))
	rank = min(max(rank, 1), n)
	return r.Latencies[rank-1]
}

func firstUint(s string) (uint64, error) {
	f := strings.Fields(s)
	if len(f) == 0 {
		return 0, fmt.Errorf("empty value")
	}
	return strconv.ParseUint(f[0], 10, 64)
}

func firstFloat(s string) (float64, error) {
	f := strings.Fields(s)
	if len(f) == 0 {
		return 0, fmt.Errorf("empty value")
	}
	return strconv.ParseFloat(f[0], 64)
}

// Options are the dnsperf flags the harness uses.
type Options struct {
	Server   string // IP
	Port     int
	DataFile string
	Duration float64 // -l seconds
	Passes   int     // -n (0: unset)
	Clients  int     // -c
	Threads  int     // -T
	Outstand int     // -q
	MaxQPS   int     // -Q (0: unlimited)
	Timeout  float64 // -t seconds (0: default)
	Verbose  bool    // -v
}

// Output is a file for dnsperf's standard output. With -v it prints a line
// per query; into a pipe, the caller would wake up to drain it all through
// the run, on the generator's core, competing with dnsperf's own receive
// loop. Into a file it costs dnsperf a write and nobody a wake-up.
type Output struct{ f *os.File }

// NewOutput creates the file in dir (removed by Close).
func NewOutput(dir string) (Output, error) {
	f, err := os.CreateTemp(dir, "dnsperf-*.out")
	return Output{f}, err
}

// File is what to give exec.Cmd as Stdout: an *os.File, which the child
// writes itself (any other writer gets a pipe and a copying goroutine).
func (o Output) File() *os.File { return o.f }

// Parse reads what dnsperf wrote, from the start.
func (o Output) Parse() (Result, error) {
	if _, err := o.f.Seek(0, io.SeekStart); err != nil {
		return Result{}, err
	}
	return Parse(o.f)
}

// Close closes and removes the file.
func (o Output) Close() error {
	err := o.f.Close()
	if rerr := os.Remove(o.f.Name()); err == nil {
		err = rerr
	}
	return err
}

// Args renders the options as dnsperf arguments.
func (o Options) Args() []string {
	a := []string{"-s", o.Server, "-p", strconv.Itoa(o.Port), "-d", o.DataFile}
	if o.Duration > 0 {
		a = append(a, "-l", strconv.FormatFloat(o.Duration, 'f', -1, 64))
	}
	if o.Passes > 0 {
		a = append(a, "-n", strconv.Itoa(o.Passes))
	}
	if o.Clients > 0 {
		a = append(a, "-c", strconv.Itoa(o.Clients))
	}
	if o.Threads > 0 {
		a = append(a, "-T", strconv.Itoa(o.Threads))
	}
	if o.Outstand > 0 {
		a = append(a, "-q", strconv.Itoa(o.Outstand))
	}
	if o.MaxQPS > 0 {
		a = append(a, "-Q", strconv.Itoa(o.MaxQPS))
	}
	if o.Timeout > 0 {
		a = append(a, "-t", strconv.FormatFloat(o.Timeout, 'f', -1, 64))
	}
	if o.Verbose {
		a = append(a, "-v")
	}
	return a
}
