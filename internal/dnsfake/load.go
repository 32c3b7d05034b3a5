package dnsfake

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// The client side of the tests' load: a prober that measures one name's answers
// while something else loads the server, and a flood of distinct queries from many
// client addresses.

// Probe is the outcome of Prober: latencies of the answered queries, and the lost ones.
type Probe struct {
	Latencies []time.Duration
	// Arrivals is each answered query's time from its send to its answer's arrival in
	// the client's socket, by the kernel's receive timestamp (MixProber, on Linux; in
	// step with Latencies): the answer's time without the client's own wake-up after
	// it, which on a CPU shared with other busy processes can be longer than the
	// answer took.
	Arrivals []time.Duration
	Lost     int // no answer within the timeout
	Failed   int // answered SERVFAIL or REFUSED (MixProber)
	// ByName is the same split by query name, and Addrs counts each answer's first
	// A record ("" for none) by name (MixProber).
	ByName map[string]*Probe
	Addrs  map[string]map[string]int
}

// Percentile returns the q-quantile (0..1) of the answered queries' latency.
func (p *Probe) Percentile(q float64) time.Duration { return quantile(p.Latencies, q) }

// ArrivalPercentile returns the q-quantile (0..1) of Arrivals, 0 without them.
func (p *Probe) ArrivalPercentile(q float64) time.Duration { return quantile(p.Arrivals, q) }

func quantile(d []time.Duration, q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

// NewProbe is an empty probe, for Add.
func NewProbe() *Probe {
	return &Probe{ByName: map[string]*Probe{}, Addrs: map[string]map[string]int{}}
}

// Add adds what q saw to p.
func (p *Probe) Add(q *Probe) {
	p.Latencies = append(p.Latencies, q.Latencies...)
	p.Arrivals = append(p.Arrivals, q.Arrivals...)
	p.Lost += q.Lost
	p.Failed += q.Failed
	for n, bq := range q.ByName {
		if p.ByName[n] == nil {
			p.ByName[n] = &Probe{}
		}
		p.ByName[n].Add(bq)
	}
	for n, m := range q.Addrs {
		if p.Addrs[n] == nil {
			p.Addrs[n] = map[string]int{}
		}
		for a, k := range m {
			p.Addrs[n][a] += k
		}
	}
}

// Over counts the answered queries slower than d.
func (p *Probe) Over(d time.Duration) int {
	n := 0
	for _, l := range p.Latencies {
		if l > d {
			n++
		}
	}
	return n
}

// Prober asks server for name (type A) over UDP, one query at a time with the given
// timeout and a pause between them, until stop is closed, and returns what it saw.
func Prober(server, name string, timeout, pause time.Duration, stop <-chan struct{}) (*Probe, error) {
	return MixProber(server, netip.Addr{}, []string{name}, timeout, pause, stop)
}

// MixProber is Prober over several names, asked in turn, from the local address local
// (any when invalid). A SERVFAIL or REFUSED answer counts in Failed, not in Latencies.
func MixProber(server string, local netip.Addr, names []string, timeout, pause time.Duration, stop <-chan struct{}) (*Probe, error) {
	var laddr *net.UDPAddr
	if local.IsValid() {
		laddr = &net.UDPAddr{IP: local.AsSlice()}
	}
	raddr, err := net.ResolveUDPAddr("udp", server)
	if err != nil {
		return nil, err
	}
	c, err := net.DialUDP("udp", laddr, raddr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	stamped := stampArrivals(c)
	p := NewProbe()
	for _, n := range names {
		if p.ByName[n] == nil {
			p.ByName[n], p.Addrs[n] = &Probe{}, map[string]int{}
		}
	}
	buf, oob := make([]byte, 4096), make([]byte, 128)
	for i := 0; ; i++ {
		select {
		case <-stop:
			return p, nil
		default:
		}
		name := names[i%len(names)]
		byName := p.ByName[name]
		m := new(dns.Msg)
		m.SetQuestion(name, dns.TypeA)
		m.Id = uint16(i)
		pkt, _ := m.Pack()
		start := time.Now()
		if _, err := c.Write(pkt); err != nil {
			return p, err
		}
		_ = c.SetReadDeadline(start.Add(timeout))
		for {
			n, oobn, _, _, err := c.ReadMsgUDP(buf, oob)
			if err != nil {
				p.Lost++
				byName.Lost++
				break
			}
			if n >= 4 && binary.BigEndian.Uint16(buf) == uint16(i) {
				if rc := buf[3] & 0xf; rc == dns.RcodeServerFailure || rc == dns.RcodeRefused {
					p.Failed++
					byName.Failed++
				} else {
					el := time.Since(start)
					p.Latencies = append(p.Latencies, el)
					byName.Latencies = append(byName.Latencies, el)
					if at, ok := arrival(oob[:oobn]); stamped && ok {
						a := min(max(at.Sub(start), 0), el)
						p.Arrivals = append(p.Arrivals, a)
						byName.Arrivals = append(byName.Arrivals, a)
					}
				}
				p.Addrs[name][firstA(buf[:n])]++
				break
			}
		}
		time.Sleep(pause)
	}
}

// firstA is the address of the first A record of the answer pkt, "" when none.
func firstA(pkt []byte) string {
	m := new(dns.Msg)
	if m.Unpack(pkt) != nil {
		return ""
	}
	for _, rr := range m.Answer {
		if a, ok := rr.(*dns.A); ok {
			return a.A.String()
		}
	}
	return ""
}

// Paced is the outcome of PacedUDP.
type Paced struct {
	Sent    int64
	Answers map[string]int64 // by rcode
}

// PacedUDP sends qps A queries a second (names from name(i)) from one UDP socket bound
// to local, without waiting for their answers (an open loop, as a busy workload's many
// threads send), until stop is closed, and counts the answers by rcode. It sends in
// batches every millisecond, catching up when it falls behind (Sent says how far).
func PacedUDP(server netip.AddrPort, local netip.Addr, qps int, name func(i int) string, stop <-chan struct{}) (*Paced, error) {
	c, err := net.DialUDP("udp", &net.UDPAddr{IP: local.AsSlice()}, net.UDPAddrFromAddrPort(server))
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetReadBuffer(4 << 20)
	p := &Paced{Answers: map[string]int64{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return // closed
			}
			if n >= 4 {
				p.Answers[dns.RcodeToString[int(buf[3]&0xf)]]++
			}
		}
	}()
	start := time.Now()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	i := 0
	m := new(dns.Msg)
	for running := true; running; {
		select {
		case <-stop:
			running = false
		case <-tick.C:
			due := int(time.Since(start).Seconds() * float64(qps))
			// Catch up at most a tenth of a second's worth per tick: a sender starved of
			// CPU falls behind (and says so in Sent) rather than never returning.
			for due = min(due, i+max(qps/10, 1)); i < due; i++ {
				m.SetQuestion(name(i), dns.TypeA)
				m.Id = uint16(i)
				pkt, _ := m.Pack()
				if _, err := c.Write(pkt); err == nil {
					p.Sent++
				}
			}
		}
	}
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second)) // the last answers
	<-done
	return p, nil
}

// Flood is the outcome of FloodUDP.
type Flood struct {
	Rcodes     map[string]int // answers within the deadline, by rcode
	Unanswered int
}

// FloodUDP sends perClient distinct A queries (name(client, i)) at once from each of
// clients source addresses net.IPv4(127, subnet, 0, client+1)... (loopback), and
// collects the answers that arrive within wait of the start.
func FloodUDP(server netip.AddrPort, subnet byte, clients, perClient int, name func(client, i int) string, wait time.Duration) (*Flood, error) {
	f := &Flood{Rcodes: map[string]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	start := time.Now()
	for ci := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src := &net.UDPAddr{IP: net.IPv4(127, subnet, byte(ci>>8), byte(ci+1))}
			c, err := net.DialUDP("udp", src, net.UDPAddrFromAddrPort(server))
			if err != nil {
				errs <- fmt.Errorf("client %d: %w", ci, err)
				return
			}
			defer c.Close()
			_ = c.SetReadBuffer(1 << 20)
			for i := range perClient {
				m := new(dns.Msg)
				m.SetQuestion(name(ci, i), dns.TypeA)
				m.Id = uint16(i)
				pkt, _ := m.Pack()
				_, _ = c.Write(pkt)
			}
			got := map[uint16]bool{}
			local := map[string]int{}
			_ = c.SetReadDeadline(start.Add(wait))
			buf := make([]byte, 4096)
			for len(got) < perClient {
				n, err := c.Read(buf)
				if err != nil {
					break
				}
				resp := new(dns.Msg)
				if resp.Unpack(buf[:n]) != nil || got[resp.Id] {
					continue
				}
				got[resp.Id] = true
				local[dns.RcodeToString[resp.Rcode]]++
			}
			mu.Lock()
			for k, v := range local {
				f.Rcodes[k] += v
			}
			f.Unanswered += perClient - len(got)
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	return f, <-errs
}
