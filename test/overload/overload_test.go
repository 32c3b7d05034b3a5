// Package overload runs the agent binary inside a memory cgroup limited to the
// DaemonSet's 256 MiB and overloads it: large upstream answers,
// thousands of reconnecting TCP clients, thousands of slow upstream misses. For each it
// proves that the agent stays under the limit (alive, no OOM kill), keeps answering
// in-table queries (p99 printed) and keeps serving /metrics.
//
// OVERLOAD_AGENT=/path/to/meshdns-ebpf runs a prebuilt binary instead of building the
// repository's (to compare with an older build).
package overload

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/agenttest"
	"github.com/meshdns/meshdns-ebpf/internal/dnsfake"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

const (
	limit     = 256 << 20
	meshName  = "productpage.default.svc.cluster.local."
	namesYAML = "table:\n  productpage.default.svc.cluster.local:\n    ips: [\"240.240.0.10\"]\n    registry: Kubernetes\n"
)

// agent is one running agent in its memory group.
type agent struct {
	t       *testing.T
	cg      *testenv.MemCgroup
	proc    *agenttest.Process
	dnsAddr string
	admin   string
	up      *dnsfake.Server
}

func agentBinary(t *testing.T) string {
	if p := os.Getenv("OVERLOAD_AGENT"); p != "" {
		return p
	}
	return agenttest.Agent(t)
}

func TestMain(m *testing.M) {
	code := m.Run()
	agenttest.RemoveBinaries()
	os.Exit(code)
}

// upstreamAnswers: big*.test TXT: ~64 KiB (truncated over UDP, whole over TCP);
// slow*.test: answered after 2 s; anything else: one A record.
func upstreamAnswers(proto string, req *dns.Msg) []*dns.Msg {
	m := new(dns.Msg)
	m.SetReply(req)
	q := req.Question[0]
	name := strings.ToLower(q.Name)
	switch {
	case strings.HasPrefix(name, "big") && q.Qtype == dns.TypeTXT:
		if proto == "udp" {
			m.Truncated = true
			return []*dns.Msg{m}
		}
		txt := strings.Repeat("x", 250)
		for range 240 { // 240 x ~263 bytes (owner names compressed): ~62 KiB
			m.Answer = append(m.Answer, &dns.TXT{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeTXT, Class: dns.ClassINET, Ttl: 3600}, Txt: []string{txt}})
		}
	case strings.HasPrefix(name, "slow"):
		time.Sleep(2 * time.Second)
		fallthrough
	default:
		if q.Qtype == dns.TypeA {
			m.Answer = []dns.RR{&dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 3600}, A: net.IPv4(192, 0, 2, 1)}}
		}
	}
	return []*dns.Msg{m}
}

func startAgent(t *testing.T) *agent {
	return startAgentWith(t, upstreamAnswers, "--authoritative=true", "--log-level", "warn")
}

// startAgentWith starts the agent (resolver only, --mode off) in its memory group with
// an upstream that answers with respond, and the extra flags.
func startAgentWith(t *testing.T, respond dnsfake.Respond, flags ...string) *agent {
	t.Helper()
	testenv.RequirePrivileged(t)
	cg := testenv.NewMemCgroup(t, limit)
	bin := agentBinary(t)
	up, err := dnsfake.Listen(dnsfake.Config{Addr: "127.0.0.1:0", Respond: respond, NoRecord: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(up.Close)
	dir := t.TempDir()
	names := filepath.Join(dir, "names.yaml")
	if err := os.WriteFile(names, []byte(namesYAML), 0o644); err != nil {
		t.Fatal(err)
	}
	a := &agent{t: t, cg: cg, up: up}
	a.dnsAddr = fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	a.admin = fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	argv := cg.JoinCommand(append([]string{bin, "run", "--mode", "off", "--listen", a.dnsAddr, "--upstream", up.Addr.String(),
		"--names", names, "--admin", a.admin, "--state-dir", dir}, flags...)...)
	a.proc = agenttest.Start(t, agenttest.Command(argv[0], argv[1:]...), agenttest.Options{Log: &agenttest.Log{Max: 1 << 20}})
	testenv.Eventually(t, 20*time.Second, func() bool {
		a.proc.MustRun(t)
		code, _ := a.get("/readyz", time.Second)
		return code == http.StatusOK
	}, "agent not ready within 20 s\n%s", a.proc.Log)
	cg.ResetPeak()
	return a
}

func (a *agent) get(path string, timeout time.Duration) (int, error) {
	c := http.Client{Timeout: timeout}
	resp, err := c.Get("http://" + a.admin + path)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

// metrics returns the named metrics' values from /metrics, as "name=value ...".
func (a *agent) metrics(names ...string) (string, error) {
	b, err := a.metricsText()
	if err != nil {
		return "", err
	}
	var out []string
	for _, line := range strings.Split(b, "\n") {
		for _, n := range names {
			if strings.HasPrefix(line, n+" ") || strings.HasPrefix(line, n+"{") {
				out = append(out, strings.Replace(line, " ", "=", 1))
			}
		}
	}
	return strings.Join(out, " "), nil
}

// metricsText is the agent's /metrics page.
func (a *agent) metricsText() (string, error) {
	c := http.Client{Timeout: 3 * time.Second}
	resp, err := c.Get("http://" + a.admin + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// probe sends in-table queries (one at a time, 2 s timeout) and scrapes /metrics until
// stop is closed, and reports what it saw.
type probeResult struct {
	*dnsfake.Probe
	scrapes, scrapeFails int
}

func (a *agent) probe(stop <-chan struct{}) *probeResult {
	r := &probeResult{Probe: &dnsfake.Probe{}}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		p, err := dnsfake.Prober(a.dnsAddr, meshName, 2*time.Second, 5*time.Millisecond, stop)
		if err != nil {
			a.t.Error(err)
		}
		if p != nil {
			r.Probe = p
		}
	}()
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond): // the scraper's pace
			}
			r.scrapes++
			if code, err := a.get("/metrics", 3*time.Second); err != nil || code != http.StatusOK {
				r.scrapeFails++
			}
		}
	}()
	wg.Wait()
	return r
}

// during runs load while probing, then checks and prints the figures.
func (a *agent) during(what string, load func()) {
	t := a.t
	stop := make(chan struct{})
	res := make(chan *probeResult, 1)
	go func() { res <- a.probe(stop) }()
	start := time.Now()
	load()
	el := time.Since(start)
	close(stop)
	r := <-res
	peak, fails, ooms := a.cg.Int("memory.max_usage_in_bytes"), a.cg.Int("memory.failcnt"), a.cg.OOMKills()
	alive := !a.proc.Exited()
	if mstats, err := a.metrics("go_memstats_heap_inuse_bytes", "go_memstats_heap_sys_bytes", "process_resident_memory_bytes", "meshdns_cache_bytes", "meshdns_cache_entries"); err == nil {
		t.Logf("%s: agent after the load: %s", what, mstats)
	}
	t.Logf("%s (%s): peak memory %.1f MiB of %d MiB (limit hits %d, OOM kills %d), agent alive %v; in-table: %d answered, %d lost, p50 %s p99 %s; /metrics: %d of %d scrapes failed",
		what, el.Round(time.Millisecond), float64(peak)/(1<<20), limit>>20, fails, ooms, alive,
		len(r.Latencies), r.Lost, r.Percentile(0.5).Round(time.Microsecond), r.Percentile(0.99).Round(time.Microsecond), r.scrapeFails, r.scrapes)
	if !alive || ooms > 0 {
		t.Fatalf("%s: the agent did not survive (alive %v, OOM kills %d)\n%s", what, alive, ooms, a.proc.Log.String())
	}
	if peak >= limit {
		t.Errorf("%s: peak memory %d reached the %d limit", what, peak, limit)
	}
	if r.Lost > 0 || len(r.Latencies) == 0 {
		t.Errorf("%s: %d in-table queries lost (%d answered): want all answered", what, r.Lost, len(r.Latencies))
	}
	if r.scrapeFails > 0 || r.scrapes == 0 {
		t.Errorf("%s: %d of %d /metrics scrapes failed", what, r.scrapeFails, r.scrapes)
	}
}

// tcpQuery sends one query on c and reads one answer.
func tcpQuery(c net.Conn, name string, qtype uint16, id uint16) (*dns.Msg, error) {
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	m.Id = id
	pkt, _ := m.Pack()
	if _, err := c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(pkt))), pkt...)); err != nil {
		return nil, err
	}
	var l [2]byte
	if _, err := io.ReadFull(c, l[:]); err != nil {
		return nil, err
	}
	b := make([]byte, binary.BigEndian.Uint16(l[:]))
	if _, err := io.ReadFull(c, b); err != nil {
		return nil, err
	}
	resp := new(dns.Msg)
	return resp, resp.Unpack(b)
}

// 10,500 names whose answers are 64 KiB (fetched over TCP) asked over TCP.
func TestLargeAnswers(t *testing.T) {
	a := startAgent(t)
	const names, workers = 10500, 32
	var next, ok, failed atomic.Int64
	a.during("10,500 names with 64 KiB answers", func() {
		var wg sync.WaitGroup
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var c net.Conn
				for {
					i := next.Add(1) - 1
					if i >= names {
						break
					}
					if c == nil {
						var err error
						if c, err = net.DialTimeout("tcp", a.dnsAddr, 5*time.Second); err != nil {
							failed.Add(1)
							continue
						}
					}
					_ = c.SetDeadline(time.Now().Add(10 * time.Second))
					resp, err := tcpQuery(c, fmt.Sprintf("big%d.test.", i), dns.TypeTXT, uint16(i))
					if err != nil {
						failed.Add(1)
						c.Close()
						c = nil
						continue
					}
					if resp.Rcode == dns.RcodeSuccess && len(resp.Answer) > 0 {
						ok.Add(1)
					} else {
						failed.Add(1)
					}
				}
				if c != nil {
					c.Close()
				}
			}()
		}
		wg.Wait()
	})
	t.Logf("large answers: %d answered in full, %d failed", ok.Load(), failed.Load())
	if ok.Load() < names/2 {
		t.Errorf("only %d of %d large answers came back", ok.Load(), names)
	}
}

// 5,000 TCP clients that connect, query, stay, and reconnect.
func TestReconnectingTCPClients(t *testing.T) {
	a := startAgent(t)
	const clients = 5000
	var answered, failed atomic.Int64
	a.during("5,000 reconnecting TCP clients", func() {
		var wg sync.WaitGroup
		deadline := time.Now().Add(8 * time.Second)
		for i := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for round := 0; time.Now().Before(deadline); round++ {
					c, err := net.DialTimeout("tcp", a.dnsAddr, 5*time.Second)
					if err != nil {
						failed.Add(1)
						time.Sleep(100 * time.Millisecond) // the client's backoff before it reconnects (load pacing)
						continue
					}
					_ = c.SetDeadline(time.Now().Add(5 * time.Second))
					if _, err := tcpQuery(c, meshName, dns.TypeA, uint16(i)); err != nil {
						failed.Add(1) // closed for a newer client: reconnect
					} else {
						answered.Add(1)
						// Stay connected (idle) for a while, as a pooled client does.
						buf := make([]byte, 1)
						_ = c.SetReadDeadline(time.Now().Add(time.Duration(500+i%1500) * time.Millisecond))
						_, _ = c.Read(buf)
					}
					c.Close()
				}
			}()
		}
		wg.Wait()
	})
	t.Logf("reconnecting clients: %d queries answered, %d connections closed or refused", answered.Load(), failed.Load())
	if answered.Load() < clients {
		t.Errorf("only %d answers for %d clients", answered.Load(), clients)
	}
}

// 10,000 simultaneous distinct slow (2 s) misses from 100 clients.
func TestSlowMisses(t *testing.T) {
	a := startAgent(t)
	var flood *dnsfake.Flood
	a.during("10,000 slow misses", func() {
		var err error
		flood, err = dnsfake.FloodUDP(netip.MustParseAddrPort(a.dnsAddr), 2, 100, 100,
			func(c, i int) string { return fmt.Sprintf("slow%d-%d.test.", c, i) }, 5*time.Second)
		if err != nil {
			t.Error(err)
		}
	})
	t.Logf("slow misses: answered within 5 s by rcode %v (upstream or fast SERVFAIL/REFUSED), %d unanswered", flood.Rcodes, flood.Unanswered)
	if flood.Unanswered != 0 {
		t.Errorf("%d slow misses got no answer within 5 s", flood.Unanswered)
	}
}
