//go:build linux

package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The budgets lane's memory breakdown: what the agent's peak is made of in each
// phase. VmHWM alone says the loaded phase costs more; these say where: the Go
// heap (in use, the collector's goal), goroutine stacks, the answer cache, and
// the resident pages outside the Go runtime's count (RssFile: the binary's
// text; RssAnon: everything anonymous, the heap among it).

// budgetMem is the highest reading of each quantity during one phase, each on
// its own (they need not peak together).
type budgetMem struct {
	rssAnon, rssFile     uint64  // bytes, /proc/PID/status
	heapInuse, heapAlloc float64 // go_memstats_heap_{inuse,alloc}_bytes
	nextGC, stack        float64 // go_memstats_next_gc_bytes, go_memstats_stack_inuse_bytes
	goroutines           float64
	cacheBytes           float64 // meshdns_cache_bytes (the cache's own estimate)
	cacheEntries         float64
	gcCycles             float64 // collections during the phase (go_gc_duration_seconds_count)
	samples              int
}

// budgetMemMetrics are the /metrics families sampled.
var budgetMemMetrics = []string{"go_memstats_heap_inuse_bytes", "go_memstats_heap_alloc_bytes", "go_memstats_next_gc_bytes",
	"go_memstats_stack_inuse_bytes", "go_goroutines", "meshdns_cache_bytes", "meshdns_cache_entries"}

// sampleMem reads the agent's resident memory every interval and its /metrics
// every metricsEvery (a scrape costs the agent allocations of its own: at 4 a
// second they were a third of what it allocated in the loaded phase) until stop is
// closed, and sends the phase's highest readings.
func sampleMem(pid int, admin string, interval, metricsEvery time.Duration, stop <-chan struct{}) <-chan budgetMem {
	out := make(chan budgetMem, 1)
	go func() {
		var m budgetMem
		t := time.NewTicker(interval)
		defer t.Stop()
		var scraped time.Time
		for {
			m.addRSS(pid)
			if time.Since(scraped) >= metricsEvery {
				m.addMetrics(admin)
				scraped = time.Now()
			}
			select {
			case <-stop:
				out <- m
				return
			case <-t.C:
			}
		}
	}()
	return out
}

func (m *budgetMem) addRSS(pid int) {
	if anon, file, err := rssParts(pid); err == nil {
		m.rssAnon, m.rssFile = max(m.rssAnon, anon), max(m.rssFile, file)
	}
}

func (m *budgetMem) addMetrics(admin string) {
	v := metricValues(admin, budgetMemMetrics)
	if v == nil {
		return
	}
	m.samples++
	m.heapInuse = max(m.heapInuse, v["go_memstats_heap_inuse_bytes"])
	m.heapAlloc = max(m.heapAlloc, v["go_memstats_heap_alloc_bytes"])
	m.nextGC = max(m.nextGC, v["go_memstats_next_gc_bytes"])
	m.stack = max(m.stack, v["go_memstats_stack_inuse_bytes"])
	m.goroutines = max(m.goroutines, v["go_goroutines"])
	m.cacheBytes = max(m.cacheBytes, v["meshdns_cache_bytes"])
	m.cacheEntries = max(m.cacheEntries, v["meshdns_cache_entries"])
}

// rssParts reads RssAnon and RssFile of pid, in bytes.
func rssParts(pid int) (anon, file uint64, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, fmt.Errorf("read status of %d: %w", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok || (k != "RssAnon" && k != "RssFile") {
			continue
		}
		kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("parse %s of %d: %w", k, pid, err)
		}
		if k == "RssAnon" {
			anon = kb << 10
		} else {
			file = kb << 10
		}
	}
	return anon, file, nil
}

// plainClient asks for /metrics uncompressed: a gzipped answer costs the agent a
// compressor's buffers (about 1 MiB of its heap), which the sampling would add to
// what it measures.
var plainClient = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableCompression: true}}

// metricValues sums the samples of each named family on the agent's /metrics
// (nil on error).
func metricValues(admin string, names []string) map[string]float64 {
	resp, err := plainClient.Get("http://" + admin + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil
	}
	out := make(map[string]float64, len(names))
	for _, l := range strings.Split(string(b), "\n") {
		for _, n := range names {
			if strings.HasPrefix(l, n+" ") || strings.HasPrefix(l, n+"{") {
				if v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64); err == nil {
					out[n] += v
				}
			}
		}
	}
	return out
}

// heapProfile saves the agent's heap profile (a build with -tags benchpprof,
// serving on pprofAddr) as dir/name.pb.gz; "" when not asked for.
func heapProfile(pprofAddr, dir, name string) (string, error) {
	if pprofAddr == "" {
		return "", nil
	}
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + pprofAddr + "/debug/pprof/heap")
	if err != nil {
		return "", fmt.Errorf("heap profile: %w (is the agent built with -tags benchpprof?)", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("heap profile: %s (is the agent built with -tags benchpprof?)", resp.Status)
	}
	path := filepath.Join(dir, name+".pb.gz")
	f, err := os.Create(path)
	if err != nil {
		return "", fmt.Errorf("heap profile: %w", err)
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return "", fmt.Errorf("heap profile %s: %w", path, err)
	}
	return path, f.Close()
}

// printBudgetMem is the breakdown table of both phases.
func printBudgetMem(w io.Writer, base, loud budgetPhase) {
	mib := func(v float64) string { return fmt.Sprintf("%.1f", v/(1<<20)) }
	fmt.Fprintln(w, "Memory breakdown, the highest reading of each in the phase (RSS sampled every 250 ms, /metrics every 2 s; MiB unless a count):")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| phase | VmHWM | RssAnon | RssFile | Go heap in use | heap alloc | GC goal | GC cycles | stacks | goroutines | cache (estimate) | cache entries | heap profile |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range []struct {
		name string
		ph   budgetPhase
	}{{"baseline", base}, {"loaded", loud}} {
		m := r.ph.mem
		prof := r.ph.profile
		if prof == "" {
			prof = "-"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %.0f | %s | %.0f | %s | %.0f | %s |\n", r.name, mib(float64(r.ph.hwm)),
			mib(float64(m.rssAnon)), mib(float64(m.rssFile)), mib(m.heapInuse), mib(m.heapAlloc), mib(m.nextGC), m.gcCycles, mib(m.stack),
			m.goroutines, mib(m.cacheBytes), m.cacheEntries, prof)
	}
}
