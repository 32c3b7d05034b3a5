package resolver

import (
	"fmt"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// burst sends n distinct A queries for <prefix><i>.example.net. from src at once, plus
// the in-table name, and returns the answers' rcodes (table answers apart) that come
// back within wait.
func burst(t *testing.T, server, src, prefix string, n int, wait time.Duration) (rcodes map[int]int, table int) {
	t.Helper()
	c, err := net.DialUDP("udp", &net.UDPAddr{IP: net.ParseIP(src)}, net.UDPAddrFromAddrPort(mustAddrPort(server)))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range n {
		m := query(fmt.Sprintf("%s%d.example.net.", prefix, i), dns.TypeA)()
		m.Id = uint16(i)
		pkt, _ := m.Pack()
		_, _ = c.Write(pkt)
	}
	m := query(testPP, dns.TypeA)()
	m.Id = 0xffff
	pkt, _ := m.Pack()
	_, _ = c.Write(pkt)
	rcodes = map[int]int{}
	_ = c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 512)
	for {
		k, err := c.Read(buf)
		if err != nil {
			return rcodes, table
		}
		resp := new(dns.Msg)
		if resp.Unpack(buf[:k]) != nil {
			continue
		}
		if resp.Id == 0xffff {
			if resp.Rcode == dns.RcodeSuccess && len(resp.Answer) == 1 {
				table++
			}
			continue
		}
		rcodes[resp.Rcode]++
	}
}

// A workload over its upstream budget gets REFUSED at once for its misses; another
// workload's misses and every table answer are unaffected.
func TestWorkloadBudgets(t *testing.T) {
	t.Run("rate", func(t *testing.T) {
		ts := startServer(t, testFile(), func(c *Config) { c.WorkloadBudget = BudgetLimits{QPS: 1, Burst: 10} })
		noisy, tableNoisy := burst(t, ts.addr, "127.0.4.1", "n", 40, time.Second)
		quiet, tableQuiet := burst(t, ts.addr, "127.0.4.2", "q", 8, time.Second)
		if noisy[dns.RcodeRefused] != 30 || noisy[dns.RcodeNameError] != 10 {
			t.Errorf("40 misses from a workload with a burst of 10: rcodes %v, want 10 NXDOMAIN (forwarded) and 30 REFUSED", noisy)
		}
		if quiet[dns.RcodeNameError] != 8 || len(quiet) != 1 {
			t.Errorf("8 misses from another workload: rcodes %v, want 8 forwarded", quiet)
		}
		if tableNoisy != 1 || tableQuiet != 1 {
			t.Errorf("table answers: noisy %d, quiet %d; want each answered while over budget", tableNoisy, tableQuiet)
		}
		if got := metrictest.Value(t, ts.reg, "meshdns_dns_overload_total", "limit", "workload"); got != 30 {
			t.Errorf("meshdns_dns_overload_total{limit=workload} = %v, want 30", got)
		}
	})
	t.Run("in flight", func(t *testing.T) {
		ts := startServer(t, testFile(), func(c *Config) { c.WorkloadBudget = BudgetLimits{InFlight: 5} })
		ts.up.SetDelay(time.Second)
		noisy, table := burst(t, ts.addr, "127.0.4.3", "f", 12, 500*time.Millisecond)
		if noisy[dns.RcodeRefused] != 7 || len(noisy) != 1 || table != 1 {
			t.Errorf("12 slow misses from a workload allowed 5 in flight: fast rcodes %v (table %d), want 7 REFUSED", noisy, table)
		}
	})
}

// overridesFunc is a BudgetOverrides from a function.
type overridesFunc func(workload.Key) (BudgetLimits, bool)

func (f overridesFunc) LimitsFor(k workload.Key) (BudgetLimits, bool) { return f(k) }

// A workload whose override gives it a larger budget has its misses forwarded where
// another workload, on the default budget, is REFUSED; a change of the override
// applies to an existing bucket once it is checked again.
func TestWorkloadBudgetOverrides(t *testing.T) {
	var mu sync.Mutex
	big := netip.MustParseAddr("127.0.4.5")
	bigLimits := BudgetLimits{QPS: 1, Burst: 30}
	ov := overridesFunc(func(k workload.Key) (BudgetLimits, bool) {
		mu.Lock()
		defer mu.Unlock()
		if k.Addr == big {
			return bigLimits, true
		}
		return BudgetLimits{}, false
	})
	ts := startServer(t, testFile(), func(c *Config) {
		c.WorkloadBudget = BudgetLimits{QPS: 1, Burst: 10}
		c.BudgetOverrides = ov
	})
	def, _ := burst(t, ts.addr, "127.0.4.4", "d", 20, time.Second)
	over, table := burst(t, ts.addr, big.String(), "o", 20, time.Second)
	if def[dns.RcodeNameError] != 10 || def[dns.RcodeRefused] != 10 {
		t.Errorf("20 misses on the default budget (burst 10): rcodes %v, want 10 NXDOMAIN and 10 REFUSED", def)
	}
	if over[dns.RcodeNameError] != 20 || len(over) != 1 || table != 1 {
		t.Errorf("20 misses from the workload with an override of burst 30: rcodes %v (table %d), want 20 NXDOMAIN", over, table)
	}

	// The override falls to a burst of 1: once the bucket is checked again its
	// tokens are capped by it, and the workload's misses are REFUSED.
	mu.Lock()
	bigLimits = BudgetLimits{QPS: 0.001, Burst: 1}
	mu.Unlock()
	var last map[int]int
	testenv.Eventually(t, 10*time.Second, func() bool {
		last, _ = burst(t, ts.addr, big.String(), "p", 5, 300*time.Millisecond)
		return last[dns.RcodeRefused] >= 4
	}, "5 misses after the override fell to burst 1: rcodes %v, want at least 4 REFUSED", &last)

	// Raised again, the workload has its larger burst at once (not only as its
	// rate refills it).
	mu.Lock()
	bigLimits = BudgetLimits{QPS: 0.001, Burst: 30}
	mu.Unlock()
	testenv.Eventually(t, 10*time.Second, func() bool {
		last, _ = burst(t, ts.addr, big.String(), "r", 20, 300*time.Millisecond)
		return last[dns.RcodeNameError] == 20
	}, "20 misses after the override rose to burst 30: rcodes %v, want 20 NXDOMAIN", &last)
}
