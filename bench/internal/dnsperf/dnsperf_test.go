package dnsperf

import (
	"math"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const summaryOut = `DNS Performance Testing Tool
Version 2.10.0

[Status] Command line: dnsperf -s 127.0.0.1 -p 25300 -d /tmp/bw/q.txt -l 1 -c 4 -q 50
[Status] Sending queries (to 127.0.0.1:25300)
[Status] Started at: Sun Nov 22 03:12:50 2026
[Status] Stopping after 1.000000 seconds
[Status] Testing complete (time limit)

Statistics:

  Queries sent:         29569
  Queries completed:    29569 (100.00%)
  Queries lost:         0 (0.00%)

  Response codes:       NOERROR 19713 (66.67%), NXDOMAIN 9856 (33.33%)
  Average packet size:  request 33, response 102
  Run time (s):         1.000425
  Queries per second:   29556.438514

  Average Latency (s):  0.001451 (min 0.000016, max 0.014848)
  Latency StdDev (s):   0.001581

`

func TestParse(t *testing.T) {
	verbose := strings.Replace(summaryOut, "[Status] Testing complete", "> NOERROR e-1.example.com A 0.000300\n"+
		"> NXDOMAIN x.nx.example.net A 0.000100\n> T e-9.example.com A\n> NOERROR e-2.example.com AAAA 0.000200\n[Status] Testing complete", 1)
	for _, tc := range []struct {
		name      string
		in        string
		wantErr   bool
		latencies []float64
		verbose   map[string]uint64
	}{
		{name: "summary", in: summaryOut},
		{name: "verbose", in: verbose, latencies: []float64{0.0001, 0.0002, 0.0003},
			verbose: map[string]uint64{"NOERROR": 2, "NXDOMAIN": 1, "T": 1}},
		{name: "no statistics", in: "DNS Performance Testing Tool\nVersion 2.10.0\n", wantErr: true},
		{name: "garbage count", in: strings.Replace(summaryOut, "29569 (100.00%)", "many", 1), wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := Parse(strings.NewReader(tc.in))
			if tc.wantErr {
				if err == nil {
					t.Fatal("no error")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if r.Version != "2.10.0" || r.Sent != 29569 || r.Completed != 29569 || r.Lost != 0 ||
				r.RunTime != 1.000425 || r.QPS != 29556.438514 || r.AvgLatency != 0.001451 {
				t.Errorf("summary = %+v", r)
			}
			if r.Rcodes["NOERROR"] != 19713 || r.Rcodes["NXDOMAIN"] != 9856 || len(r.Rcodes) != 2 {
				t.Errorf("rcodes = %v", r.Rcodes)
			}
			if !slices.Equal(r.Latencies, tc.latencies) {
				t.Errorf("latencies = %v, want %v", r.Latencies, tc.latencies)
			}
			for k, v := range tc.verbose {
				if r.VerboseRcodes[k] != v {
					t.Errorf("verbose rcodes = %v, want %v", r.VerboseRcodes, tc.verbose)
				}
			}
		})
	}
}

func TestPercentile(t *testing.T) {
	var r Result
	if !math.IsNaN(r.Percentile(0.5)) {
		t.Error("no samples: want NaN")
	}
	for i := 1; i <= 100; i++ {
		r.Latencies = append(r.Latencies, float64(i))
	}
	for _, tc := range []struct{ q, want float64 }{{0.5, 50}, {0.99, 99}, {0.999, 100}, {1, 100}, {0, 1}, {0.01, 1}} {
		if got := r.Percentile(tc.q); got != tc.want {
			t.Errorf("Percentile(%v) = %v, want %v", tc.q, got, tc.want)
		}
	}
	// A percentage where a fraction belongs is not a plausible number.
	for _, q := range []float64{99, 50, -0.1} {
		if got := r.Percentile(q); !math.IsNaN(got) {
			t.Errorf("Percentile(%v) = %v, want NaN", q, got)
		}
	}
}

func TestArgs(t *testing.T) {
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{Server: "127.0.0.1", Port: 53, DataFile: "q", Passes: 2}, "-s 127.0.0.1 -p 53 -d q -n 2"},
		{Options{Server: "127.0.0.1", Port: 5301, DataFile: "q", Duration: 10, Clients: 4, Threads: 1, Outstand: 200},
			"-s 127.0.0.1 -p 5301 -d q -l 10 -c 4 -T 1 -q 200"},
		{Options{Server: "::1", Port: 5301, DataFile: "q", Duration: 2.5, MaxQPS: 20000, Verbose: true, Timeout: 1},
			"-s ::1 -p 5301 -d q -l 2.5 -Q 20000 -t 1 -v"},
	} {
		if got := strings.Join(tc.o.Args(), " "); got != tc.want {
			t.Errorf("Args = %q, want %q", got, tc.want)
		}
	}
}

// TestOutput: a child process writes dnsperf's report into the file
// directly, Parse reads it from the start, Close removes it.
func TestOutput(t *testing.T) {
	o, err := NewOutput(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("cat")
	cmd.Stdin, cmd.Stdout = strings.NewReader(summaryOut), o.File()
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	res, err := o.Parse()
	if err != nil {
		t.Fatal(err)
	}
	if res.Completed != 29569 {
		t.Errorf("completed %d, want 29569", res.Completed)
	}
	name := o.File().Name()
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(name); !os.IsNotExist(err) {
		t.Errorf("%s still there after Close: %v", name, err)
	}
}
