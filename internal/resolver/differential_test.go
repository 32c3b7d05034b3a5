package resolver

import (
	"fmt"
	"hash/fnv"
	"log/slog"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
	"github.com/meshdns/meshdns-ebpf/internal/resolver/upstream"
)

// The differential test: random tables and questions, each question decoded and
// decided once, and that one decision rendered twice: by the wire encoder (the dns.Msg
// encoder where the wire encoder declines, as serve does) and by the dns.Msg encoder
// alone. The two responses must be the same message, record for record, and the
// renderings must take no table snapshot of their own. The generator draws every choice from a chooser: a
// seeded *rand.Rand in TestPathsAgree, the fuzzer's bytes in FuzzPathsAgree.

// chooser is where the generator's choices come from.
type chooser interface{ IntN(n int) int }

// byteChooser draws choices from fuzz input; past its end every choice is 0.
type byteChooser struct{ b []byte }

func (c *byteChooser) IntN(n int) int {
	if n <= 1 || len(c.b) == 0 {
		return 0
	}
	v := int(c.b[0])
	c.b = c.b[1:]
	if n > 256 && len(c.b) > 0 {
		v = v<<8 | int(c.b[0])
		c.b = c.b[1:]
	}
	return v % n
}

func pick[T any](c chooser, xs []T) T { return xs[c.IntN(len(xs))] }

// diffWorld is one generated table, the server configuration that answers from it,
// and the names and clients questions are drawn from.
type diffWorld struct {
	w       *worker
	tables  *countingTable
	out     []byte // the response buffer, reused
	desc    string // the configuration, for failure messages
	names   []string
	clients []netip.Addr
	nsOf    map[netip.Addr]string
}

var (
	diffNamespaces = []string{"ns0", "ns1", "ns2", "ns3"}
	diffShorts     = []string{"web", "api", "db", "reviews", "a-b"}
	// External names: in the table when drawn as hosts, else forwarded.
	diffExternal = []string{"api.example.com", "a.b.example.com", "www.example.org", "ext.example.org",
		"deep.x.y.example.net", "svc.example.com", "single"}
)

// diffAddrs is up to max random addresses, v4 or v6.
func diffAddrs(c chooser, v6 bool, max int) []netip.Addr {
	var out []netip.Addr
	for range c.IntN(max + 1) {
		if v6 {
			out = append(out, netip.AddrFrom16([16]byte{0xfd, 0, 15: byte(1 + c.IntN(250))}))
		} else {
			out = append(out, netip.AddrFrom4([4]byte{10, 96, byte(c.IntN(4)), byte(1 + c.IntN(250))}))
		}
	}
	return slices.Compact(out)
}

// genWorld generates a table and a server answering from it.
func genWorld(tb testing.TB, c chooser) *diffWorld {
	tb.Helper()
	nss := diffNamespaces[:1+c.IntN(len(diffNamespaces))]
	b, err := nametable.NewBuilder(nametable.Options{})
	if err != nil {
		tb.Fatal(err)
	}
	b.AddSource("test", 0)
	var names []string
	// CNAME targets: in the table, outside it, missing under the cluster domain.
	targets := []string{"web.ns0.svc.cluster.local", "ext.example.org", "api.example.com",
		"gone.ns1.svc.cluster.local", "alias.example.com"}
	nHosts := 3 + c.IntN(12)
	for i := range nHosts {
		var h nametable.Host
		switch c.IntN(6) {
		case 0, 1: // a Kubernetes Service
			short, ns := pick(c, diffShorts), pick(c, nss)
			h = nametable.Host{Name: short + "." + ns + ".svc.cluster.local", Kubernetes: true}
			names = append(names, short+"."+ns+".", short+"."+ns+".svc.", short+".")
		case 2: // a headless endpoint: its Service's name is an empty non-terminal
			h = nametable.Host{Name: fmt.Sprintf("pod-%d.hl.%s.svc.cluster.local", c.IntN(3), pick(c, nss))}
			names = append(names, h.Name[strings.IndexByte(h.Name, '.')+1:]+".")
		case 3: // an external host
			h = nametable.Host{Name: pick(c, diffExternal), NeedVIP: c.IntN(3) == 0}
		case 4: // a wildcard
			h = nametable.Host{Name: pick(c, []string{"*.wild.example.com", "*.example.org", "*.apps.ns0.svc.cluster.local"})}
			names = append(names, strings.Replace(h.Name, "*", "x", 1)+".", strings.Replace(h.Name, "*", "a.b", 1)+".")
		case 5: // an alias (ExternalName)
			h = nametable.Host{Name: pick(c, []string{"alias.example.com", "ext." + pick(c, nss) + ".svc.cluster.local"}),
				Kubernetes: c.IntN(2) == 0, Extra: &nametable.HostExtra{CNAME: pick(c, targets)}}
		}
		if h.Extra == nil && !h.NeedVIP && !strings.HasPrefix(h.Name, "*") || h.Extra == nil && c.IntN(2) == 0 {
			h.V4, h.V6 = diffAddrs(c, false, 3), diffAddrs(c, true, 2)
			if c.IntN(12) == 0 {
				h.V4 = diffAddrs(c, false, 60) // may need truncation
			}
			if len(h.V4)+len(h.V6) > 0 {
				h.NeedVIP = false
			}
		}
		if c.IntN(4) == 0 {
			if h.Extra == nil {
				h.Extra = &nametable.HostExtra{}
			}
			h.Extra.Visible = []string{pick(c, nss)}
		}
		names = append(names, strings.ToLower(h.Name)+".")
		// Keys are per host: the same name from two keys makes clients that do not
		// see one host get the other.
		_ = b.Set("test", "k"+strconv.Itoa(i), []nametable.Host{h}) // an invalid host is left out
	}
	w := &diffWorld{nsOf: map[netip.Addr]string{}, out: make([]byte, dns.MaxMsgSize)}
	for i, ns := range nss {
		ip := netip.AddrFrom4([4]byte{10, 1, byte(i), 1})
		if err := b.SetClients("test", "pod-"+ns, []netip.Addr{ip}, ns); err != nil {
			tb.Fatal(err)
		}
		w.clients = append(w.clients, ip)
		w.nsOf[ip] = ns
	}
	w.clients = append(w.clients, netip.MustParseAddr("10.9.9.9")) // unknown
	t, err := b.Publish()
	if err != nil {
		tb.Fatal(err)
	}
	// Names not in the table, search-path expansions of every name, empty
	// non-terminals, pod records.
	names = append(names, "nope.ns0.svc.cluster.local.", "nope.example.org.", "svc.cluster.local.",
		"cluster.local.", "ns0.svc.cluster.local.", "b.example.com.", "10-1-2-3.ns0.pod.cluster.local.")
	for _, e := range diffExternal {
		names = append(names, e+".")
	}
	bases := slices.Clone(names)
	for range 24 {
		base := pick(c, bases)
		names = append(names, base+pick(c, nss)+".svc.cluster.local.", base+"svc.cluster.local.",
			base+"cluster.local.", base+"corp.internal.")
	}
	slices.Sort(names)
	w.names = slices.Compact(names)

	w.tables = &countingTable{}
	w.tables.t.Store(t)
	cfg := Config{Listen: []string{"127.0.0.1:0"}, Table: w.tables, Forwarder: diffForwarder{},
		Authoritative: c.IntN(4) != 0, PodRecords: c.IntN(2) == 0, FilterAAAA: c.IntN(4) == 0, Logger: slog.New(slog.DiscardHandler)}
	if c.IntN(2) == 0 {
		cfg.SearchDomains = []string{"corp.internal"}
	}
	s, err := New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	w.w = newWorker(s)
	w.desc = fmt.Sprintf("authoritative=%v pods=%v filter-aaaa=%v search=%v clients=%v table:\n%s", cfg.Authoritative, cfg.PodRecords,
		cfg.FilterAAAA, cfg.SearchDomains, w.nsOf, describeTable(t))
	return w
}

// describeTable lists a table's hosts for failure messages.
func describeTable(t *nametable.Table) string {
	var b strings.Builder
	t.Each(func(owner string, n *nametable.Name) bool {
		h := n.Host
		fmt.Fprintf(&b, "  %s: %s v4=%v v6=%v cname=%q", owner, h.Name, h.V4, h.V6, h.CNAME())
		if h.Extra != nil && h.Extra.Visible != nil {
			fmt.Fprintf(&b, " visible=%v", h.Extra.Visible)
		}
		b.WriteByte('\n')
		return true
	})
	return b.String()
}

// diffQuestion is one generated question: the packet and who sends it how.
type diffQuestion struct {
	pkt    []byte
	client netip.Addr
	proto  proto
	ns     string // the client's namespace ("" = unknown client)
}

func (q diffQuestion) String() string {
	m := new(dns.Msg)
	if err := m.Unpack(q.pkt); err != nil {
		return fmt.Sprintf("%x: %v", q.pkt, err)
	}
	return fmt.Sprintf("%s from %v (ns %q) over %s, edns=%v", m.Question[0].String(), q.client, q.ns,
		protoNames[q.proto], m.IsEdns0() != nil)
}

// genQuestion draws a question, of a type the wire encoder renders (A or AAAA) three
// times in four, else of another type, in random case, with or without EDNS, from a
// known or an unknown client.
func genQuestion(c chooser, w *diffWorld) diffQuestion {
	name := []byte(pick(c, w.names))
	for i := range name {
		if 'a' <= name[i] && name[i] <= 'z' && c.IntN(8) == 0 {
			name[i] -= 'a' - 'A'
		}
	}
	m := new(dns.Msg)
	qtype := pick(c, []uint16{dns.TypeA, dns.TypeAAAA})
	if c.IntN(4) == 0 {
		qtype = pick(c, []uint16{dns.TypeSRV, dns.TypeANY, dns.TypeCNAME, dns.TypeTXT, dns.TypePTR, dns.TypeSOA, dns.TypeMX, dns.TypeHTTPS})
	}
	m.SetQuestion(string(name), qtype)
	m.Id = uint16(c.IntN(1 << 16))
	m.RecursionDesired = c.IntN(4) != 0
	m.CheckingDisabled = c.IntN(8) == 0
	if e := c.IntN(5); e > 0 {
		m.SetEdns0([]uint16{0, 512, 1232, 4096, 65535}[e], c.IntN(2) == 0)
	}
	pkt, err := m.Pack()
	if err != nil {
		panic(err)
	}
	q := diffQuestion{pkt: pkt, client: pick(c, w.clients), proto: protoUDP}
	q.ns = w.nsOf[q.client]
	if c.IntN(4) == 0 {
		q.proto = protoTCP
	}
	return q
}

// diffForwarder is the upstream of the differential test, in-process and
// deterministic: the answer depends only on the name and type asked (NXDOMAIN,
// NODATA, a CNAME chain, too many records for UDP, an extended rcode, a few
// addresses); half of the names are cached, the other half answered at once
// through ForwardAsync, which fails some of them.
type diffForwarder struct{}

func diffHash(name string, qtype uint16) uint32 {
	h := fnv.New32a()
	h.Write([]byte(name))
	h.Write([]byte{byte(qtype >> 8), byte(qtype)})
	return h.Sum32()
}

func (diffForwarder) answer(q *upstream.Query) upstream.Answer {
	h := diffHash(q.Name, q.Qtype)
	a := upstream.Answer{RecursionAvailable: true, Source: upstream.SourceUpstream}
	var an, ns []dns.RR
	addr := func(owner string, i int) dns.RR {
		hdr := dns.RR_Header{Name: owner, Rrtype: q.Qtype, Class: dns.ClassINET, Ttl: 120}
		switch q.Qtype {
		case dns.TypeAAAA:
			return &dns.AAAA{Hdr: hdr, AAAA: netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i + 1)}).AsSlice()}
		case dns.TypeA:
		default: // another type: a TXT record stands for its data
			hdr.Rrtype = dns.TypeTXT
			return &dns.TXT{Hdr: hdr, Txt: []string{fmt.Sprintf("record %d of %s", i, dns.TypeToString[q.Qtype])}}
		}
		return &dns.A{Hdr: hdr, A: netip.AddrFrom4([4]byte{192, 0, 2, byte(i + 1)}).AsSlice()}
	}
	soa := &dns.SOA{Hdr: dns.RR_Header{Name: "example.", Rrtype: dns.TypeSOA, Class: dns.ClassINET, Ttl: 60},
		Ns: "ns.example.", Mbox: "h.example.", Serial: 1, Minttl: 60}
	switch h % 7 {
	case 6:
		a.Rcode = 23 // BADCOOKIE: an extended rcode, only expressible with EDNS
	case 0:
		a.Rcode, ns = dns.RcodeNameError, []dns.RR{soa}
	case 1:
		ns = []dns.RR{soa} // NODATA
	case 2:
		an = append(an, &dns.CNAME{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: 120},
			Target: "edge.example.net."}, addr("edge.example.net.", 0), addr("edge.example.net.", 1))
	case 3:
		for i := range 40 { // needs truncation over UDP
			an = append(an, addr(q.Name, i))
		}
	default:
		for i := range 1 + int(h>>8)%3 {
			an = append(an, addr(q.Name, i))
		}
		a.Authoritative = h>>12&1 == 1
		a.AuthenticData = h>>13&1 == 1
	}
	buf := make([]byte, 4096)
	off := 0
	for _, rr := range append(an, ns...) {
		var err error
		if off, err = dns.PackRR(rr, buf, off, nil, false); err != nil {
			panic(err)
		}
	}
	a.Records, a.Answer, a.Authority = buf[:off], uint16(len(an)), uint16(len(ns))
	return a
}

func (f diffForwarder) Cached(q *upstream.Query) (upstream.Answer, bool) {
	if diffHash(q.Name, 0)&1 == 0 {
		return upstream.Answer{}, false
	}
	a := f.answer(q)
	a.Source = upstream.SourceCache
	return a, true
}

func (f diffForwarder) ForwardAsync(q *upstream.Query, done upstream.Waiter) {
	if diffHash(q.Name, q.Qtype)%11 == 0 {
		done(upstream.Answer{}, upstream.ErrAllFailed) // no upstream answered
		return
	}
	done(f.answer(q), nil)
}

// countingTable is a TableSource that counts the snapshots taken: one per decision.
type countingTable struct {
	staticTable
	n atomic.Int64
}

func (c *countingTable) Table() *nametable.Table {
	c.n.Add(1)
	return c.staticTable.Table()
}

// diffRender renders decision d of request r with the wire encoder (forceMsg false:
// the dns.Msg encoder only where the wire encoder declines) or with the dns.Msg
// encoder alone, and returns the response (the one sent later, for a query that was
// forwarded).
func diffRender(w *worker, r *request, d *decision, out []byte, ch chan []byte, forceMsg bool) (*dns.Msg, error) {
	r.pending, r.p = false, nil
	w.forceMsg = forceMsg
	defer func() { w.forceMsg = false }()
	b := w.encode(r, d, out)
	if b == nil {
		select {
		case b = <-ch:
		default:
			return nil, fmt.Errorf("no answer")
		}
	}
	m := new(dns.Msg)
	if err := m.Unpack(b); err != nil {
		return nil, fmt.Errorf("answer does not unpack: %w", err)
	}
	return m, nil
}

// diffCheck decodes q and decides it once, renders that one decision with both
// encoders, and describes how the responses differ ("" = not). Rendering looks
// nothing up: the table is taken once, by decide.
func diffCheck(w *diffWorld, q diffQuestion) string {
	wk := w.w
	ch := make(chan []byte, 1)
	c := &client{proto: q.proto, addr: q.client}
	c.reply.sync = ch
	r := wk.newRequest(q.pkt, c, time.Now())
	if !wk.decodeWire(r) {
		if _, done := wk.decodeMsg(r, w.out); done {
			return "" // screened: never decided
		}
	}
	tables, decided := w.tables.n.Load(), wk.decided
	d := new(decision)
	wk.decide(r, d)
	fm, err := diffRender(wk, r, d, w.out, ch, false)
	if err != nil {
		return "wire encoder: " + err.Error()
	}
	gm, err := diffRender(wk, r, d, w.out, ch, true)
	if err != nil {
		return "dns.Msg encoder: " + err.Error()
	}
	if n, k := w.tables.n.Load()-tables, wk.decided-decided; n != 1 || k != 1 {
		return fmt.Sprintf("%s: %d table snapshots and %d decisions for one query and two renderings, want 1 and 1", q, n, k)
	}
	fc, gc := canon(fm), canon(gm)
	if fm.Truncated && gm.Truncated {
		// Which shuffled records survive truncation differs: compare the rest.
		fc, gc = canonTruncated(fm), canonTruncated(gm)
	}
	if fc == gc {
		return ""
	}
	return fmt.Sprintf("%s\nwire encoder:\n%sdns.Msg encoder:\n%s", q, fc, gc)
}

// canonTruncated is canon for a truncated response: the header, the question and
// each section's record types.
func canonTruncated(m *dns.Msg) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %v\n", m.MsgHdr.String(), m.Question)
	for _, sec := range [][]dns.RR{m.Answer, m.Ns, m.Extra} {
		for _, rr := range sec {
			fmt.Fprintf(&b, "%s ", dns.TypeToString[rr.Header().Rrtype])
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// TestPathsAgree answers diffCases generated questions (100,000 by default;
// MESHDNS_DIFF_CASES and MESHDNS_DIFF_SEED change them) over generated tables both
// ways; the two responses must be equal.
func TestPathsAgree(t *testing.T) {
	cases, seed := 100_000, uint64(1)
	if v := os.Getenv("MESHDNS_DIFF_CASES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("MESHDNS_DIFF_CASES: %v", err)
		}
		cases = n
	}
	if v := os.Getenv("MESHDNS_DIFF_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("MESHDNS_DIFF_SEED: %v", err)
		}
		seed = n
	}
	const perWorld = 250
	failed := 0
	for world := 0; world*perWorld < cases; world++ {
		rng := rand.New(rand.NewPCG(seed, uint64(world)))
		w := genWorld(t, rng)
		for i := range min(perWorld, cases-world*perWorld) {
			if d := diffCheck(w, genQuestion(rng, w)); d != "" {
				failed++
				if failed <= 3 {
					t.Errorf("seed %d world %d case %d: the paths disagree: %s\nworld: %s", seed, world, i, d, w.desc)
				}
			}
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d cases disagree", failed, cases)
	}
}

// FuzzPathsAgree is TestPathsAgree with the fuzzer's bytes as the generator's
// choices: a table, then questions until the input is used up.
func FuzzPathsAgree(f *testing.F) {
	for seed := range uint64(8) {
		b := make([]byte, 200)
		rng := rand.New(rand.NewPCG(seed, 0))
		for i := range b {
			b[i] = byte(rng.IntN(256))
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		c := &byteChooser{b: in}
		w := genWorld(t, c)
		for range 64 {
			if d := diffCheck(w, genQuestion(c, w)); d != "" {
				t.Fatalf("the paths disagree: %s\nworld: %s", d, w.desc)
			}
			if len(c.b) == 0 {
				return
			}
		}
	})
}

// Each query served whole is decided once from one table snapshot, whichever encoder
// renders it: the wire encoder declining (truncation, other types, alias chains, SRV)
// does not make a second lookup.
func TestOneLookupPerQuery(t *testing.T) {
	rendered := map[bool]int{} // by whether the dns.Msg encoder rendered it
	for world := range 40 {
		rng := rand.New(rand.NewPCG(7, uint64(world)))
		w := genWorld(t, rng)
		for range 250 {
			q := genQuestion(rng, w)
			ch := make(chan []byte, 1)
			c := &client{proto: q.proto, addr: q.client}
			c.reply.sync = ch
			tables, decided, unpacked := w.tables.n.Load(), w.w.decided, w.w.unpacked
			if b := w.w.serve(q.pkt, w.out, c, time.Now()); b == nil {
				<-ch
			}
			if n, k := w.tables.n.Load()-tables, w.w.decided-decided; n != 1 || k != 1 {
				t.Fatalf("%s: %d table snapshots and %d decisions, want 1 and 1\nworld: %s", q, n, k, w.desc)
			}
			rendered[w.w.unpacked != unpacked]++
		}
	}
	if rendered[false] == 0 || rendered[true] == 0 {
		t.Fatalf("rendered by the wire encoder alone %d times, with the dns.Msg encoder %d times: want both", rendered[false], rendered[true])
	}
	t.Logf("wire encoder: %d queries, dns.Msg encoder (declined or another type): %d", rendered[false], rendered[true])
}
