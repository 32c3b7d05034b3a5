package redirect

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// HookStats are the counters of one program (or their total), summed over CPUs,
// in the order of CounterNames. In JSON they are flat: {"hook": ..., "<name>": n}.
type HookStats struct {
	Hook     string
	Counters []uint64
}

// Get returns the counter called name (one of CounterNames), or 0.
func (h HookStats) Get(name string) uint64 {
	for i, n := range CounterNames() {
		if n == name && i < len(h.Counters) {
			return h.Counters[i]
		}
	}
	return 0
}

// MarshalJSON writes {"hook": ..., "redirected_udp": n, ...} in counter order.
func (h HookStats) MarshalJSON() ([]byte, error) {
	return flatJSON("hook", h.Hook, CounterNames(), h.Counters)
}

func flatJSON(key string, value any, names []string, counters []uint64) ([]byte, error) {
	var b bytes.Buffer
	kb, _ := json.Marshal(key)
	vb, err := json.Marshal(value)
	if err != nil {
		return nil, err
	}
	b.WriteByte('{')
	b.Write(kb)
	b.WriteByte(':')
	b.Write(vb)
	for i, n := range names {
		var c uint64
		if i < len(counters) {
			c = counters[i]
		}
		fmt.Fprintf(&b, ",%q:%d", n, c)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// CgroupStats are the counters of the sockets of one cgroup, summed over CPUs and
// hooks.
type CgroupStats struct {
	ID             uint64 `json:"id"`
	Path           string `json:"path"` // directory under the cgroup2 mount; empty when the cgroup is gone
	RedirectedUDP  uint64 `json:"redirected_udp"`
	RedirectedTCP  uint64 `json:"redirected_tcp"`
	ReplyRewritten uint64 `json:"reply_rewritten"`
	Skipped        uint64 `json:"skipped"`
	// Pod is the cgroup's Kubernetes Pod (namespace/name) when the CLI
	// knows it; the table shows it instead of the path.
	Pod string `json:"pod,omitempty"`
}

// Redirected is the number of redirected queries (UDP datagrams sent with an
// address, UDP and TCP connects).
func (c CgroupStats) Redirected() uint64 { return c.RedirectedUDP + c.RedirectedTCP }

// counter is the field of enum cgroup_counter value i.
func (c *CgroupStats) counter(i redirectCgroupCounter) *uint64 {
	switch i {
	case redirectCgroupCounterCGROUP_REDIRECTED_UDP:
		return &c.RedirectedUDP
	case redirectCgroupCounterCGROUP_REDIRECTED_TCP:
		return &c.RedirectedTCP
	case redirectCgroupCounterCGROUP_REPLY_REWRITTEN:
		return &c.ReplyRewritten
	case redirectCgroupCounterCGROUP_SKIPPED:
		return &c.Skipped
	}
	return nil
}

// Stats are the datapath's counters.
type Stats struct {
	Hooks   []HookStats   `json:"hooks"`
	Total   HookStats     `json:"total"`
	Cgroups []CgroupStats `json:"cgroups"` // most redirected first
}

func notPinned(pinDir string) error {
	return fmt.Errorf("no meshdns datapath pinned at %s: is the agent running?", pinDir)
}

func loadPinnedMap(pinDir, name string) (*ebpf.Map, error) {
	p := filepath.Join(pinDir, mapsDir, name)
	m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
	if errors.Is(err, os.ErrNotExist) {
		return nil, notPinned(pinDir)
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned map %s: %w", p, err)
	}
	return m, nil
}

// ReadStats reads the counters from the maps pinned under pinDir (the CLI).
func ReadStats(pinDir string) (*Stats, error) {
	statsMap, err := loadPinnedMap(pinDir, redirectMapStats)
	if err != nil {
		return nil, err
	}
	defer statsMap.Close()
	cgMap, err := loadPinnedMap(pinDir, redirectMapCgroupStats)
	if err != nil {
		return nil, err
	}
	defer cgMap.Close()
	return readStats(statsMap, cgMap, cgroup2.Walk)
}

// HookStats reads the per-hook counters from the live maps: what a metrics
// scrape needs, without opening pins or walking the cgroup tree.
func (d *Datapath) HookStats() ([]HookStats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.objs.Stats == nil {
		return nil, errors.New("datapath is not started or closed")
	}
	return readHookStats(d.objs.Stats)
}

// Stats reads every counter from the live maps; cgroup paths come from a cache
// that walks the cgroup tree only for ids it has not seen.
func (d *Datapath) Stats() (*Stats, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.objs.Stats == nil {
		return nil, errors.New("datapath is not started or closed")
	}
	return readStats(d.objs.Stats, d.objs.CgroupStats, d.cgroups.Paths)
}

func readHookStats(statsMap *ebpf.Map) ([]HookStats, error) {
	names := CounterNames()
	out := make([]HookStats, 0, len(hooks))
	for _, h := range hooks {
		var perCPU []redirectHookCounters
		if err := statsMap.Lookup(uint32(h.row), &perCPU); err != nil {
			return nil, fmt.Errorf("read counters of %s: %w", h.name, err)
		}
		hs := HookStats{Hook: h.name, Counters: make([]uint64, len(names))}
		for _, c := range perCPU {
			for j := range names {
				hs.Counters[j] += c.Counters[j]
			}
		}
		out = append(out, hs)
	}
	return out, nil
}

func readStats(statsMap, cgMap *ebpf.Map, paths func([]uint64) map[uint64]string) (*Stats, error) {
	hs, err := readHookStats(statsMap)
	if err != nil {
		return nil, err
	}
	s := &Stats{Hooks: hs, Total: HookStats{Hook: "TOTAL", Counters: make([]uint64, len(CounterNames()))}}
	for _, h := range hs {
		for j, c := range h.Counters {
			s.Total.Counters[j] += c
		}
	}
	var (
		id     uint64
		perCPU []redirectCgroupCounters
		ids    []uint64
	)
	it := cgMap.Iterate()
	for it.Next(&id, &perCPU) {
		cs := CgroupStats{ID: id}
		for _, c := range perCPU {
			for j := range c.Counters {
				if f := cs.counter(redirectCgroupCounter(j)); f != nil {
					*f += c.Counters[j]
				}
			}
		}
		s.Cgroups = append(s.Cgroups, cs)
		ids = append(ids, id)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read per-cgroup counters: %w", err)
	}
	p := paths(ids)
	for i := range s.Cgroups {
		s.Cgroups[i].Path = p[s.Cgroups[i].ID]
	}
	sort.SliceStable(s.Cgroups, func(i, j int) bool {
		a, b := s.Cgroups[i], s.Cgroups[j]
		if a.Redirected() != b.Redirected() {
			return a.Redirected() > b.Redirected()
		}
		if a.Skipped != b.Skipped {
			return a.Skipped > b.Skipped
		}
		return a.ID < b.ID
	})
	return s, nil
}

// WriteTable writes the per-hook counters with a TOTAL row, then the per-cgroup
// counters (most redirected first), as aligned tables.
func (s *Stats) WriteTable(w io.Writer) error {
	names := CounterNames()
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head := []string{"HOOK"}
	for _, n := range names {
		head = append(head, strings.ToUpper(n))
	}
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	row := func(h HookStats) {
		cols := []string{h.Hook}
		for j := range names {
			var c uint64
			if j < len(h.Counters) {
				c = h.Counters[j]
			}
			cols = append(cols, fmt.Sprint(c))
		}
		fmt.Fprintln(tw, strings.Join(cols, "\t"))
	}
	for _, h := range s.Hooks {
		row(h)
	}
	row(s.Total)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)

	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head = []string{"CGROUP ID", "PATH"}
	for _, n := range CgroupCounterNames() {
		head = append(head, strings.ToUpper(n))
	}
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	for _, c := range s.Cgroups {
		path := c.Path
		if path == "" {
			path = "(removed)"
		}
		if c.Pod != "" {
			path = "pod " + c.Pod
		}
		cols := []string{fmt.Sprint(c.ID), path}
		for j := range CgroupCounterNames() {
			cols = append(cols, fmt.Sprint(*c.counter(redirectCgroupCounter(j))))
		}
		fmt.Fprintln(tw, strings.Join(cols, "\t"))
	}
	return tw.Flush()
}

// NameserverSlot is a captured nameserver and the resolver port it goes to.
type NameserverSlot struct {
	Address netip.Addr `json:"address"`
	Slot    int        `json:"slot"`
	Port    uint16     `json:"port"`
}

// Status describes the pinned datapath.
type Status struct {
	PinDir          string           `json:"pin_dir"`
	Programs        []ProgramInfo    `json:"programs"`
	ResolverSockets int              `json:"resolver_sockets"` // registered resolver sockets (0: capture is off)
	Dequeued        uint64           `json:"dequeued"`         // datagrams and connections the resolver read
	Stalled         bool             `json:"stalled"`          // a watch aged past the stall timeout and a quarter more (the programs' second look)
	WatchAge        time.Duration    `json:"watch_age_ns"`     // age of the running watch with no dequeue since; 0: none
	WatchClock      bool             `json:"watch_clock"`      // the watch clock ticked within clockFresh (watchclock.go)
	Capturing       bool             `json:"capturing"`        // resolver sockets registered and not stalled
	StallAfter      time.Duration    `json:"stall_after_ns"`
	Target4         netip.AddrPort   `json:"target4"`
	Target6         netip.AddrPort   `json:"target6"`
	SlotPorts       []uint16         `json:"slot_ports"`
	Nameservers     []NameserverSlot `json:"nameservers"`
	CaptureAll      bool             `json:"capture_all"`
	CaptureLoopback bool             `json:"capture_loopback"`
	UpstreamMark    uint32           `json:"upstream_mark"`
	ProxyUIDs       []uint32         `json:"proxy_uids"`
	// CgroupPrograms are the programs that run for the capture cgroup's
	// sockets on our hooks, ours and others', in order.
	CgroupPrograms      []CgroupProgram `json:"cgroup_programs,omitempty"`
	CgroupProgramsError string          `json:"cgroup_programs_error,omitempty"`
	// Backends counts the backends of the captured nameservers the programs
	// capture after another datapath's translation; Capture says, per
	// forward hook, whether ours run first and how queries are captured.
	Backends int           `json:"backends"`
	Capture  []HookCapture `json:"capture,omitempty"`
}

// ReadStatus reads what is attached and how it is configured from the links and
// maps pinned under pinDir.
func ReadStatus(pinDir string) (*Status, error) {
	var maps [5]*ebpf.Map
	for i, name := range []string{redirectMapConfig, redirectMapProgress, redirectMapNameservers, redirectMapProxyUids, redirectMapResolverSocks} {
		m, err := loadPinnedMap(pinDir, name)
		if err != nil {
			return nil, err
		}
		defer m.Close()
		maps[i] = m
	}
	cfgMap, progMap, nsMap, uidMap, sockMap := maps[0], maps[1], maps[2], maps[3], maps[4]

	st := &Status{PinDir: pinDir}
	var c redirectMeshdnsConfig
	if err := cfgMap.Lookup(uint32(0), &c); err != nil {
		return nil, fmt.Errorf("read config map: %w", err)
	}
	var p redirectMeshdnsProgress
	if err := progMap.Lookup(uint32(0), &p); err != nil {
		return nil, fmt.Errorf("read progress map: %w", err)
	}
	st.Dequeued = p.Dequeued
	st.StallAfter = time.Duration(c.StallNs)
	if now := monotonicNow(); p.WatchSince != 0 && p.WatchCount == p.Dequeued && now >= p.WatchSince {
		st.WatchAge = time.Duration(now - p.WatchSince)
		st.Stalled = st.WatchAge > st.StallAfter+st.StallAfter/4
	}
	var key uint32
	var cookie uint64
	it := sockMap.Iterate()
	for it.Next(&key, &cookie) {
		st.ResolverSockets++
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read resolver_socks map: %w", err)
	}
	st.Capturing = st.ResolverSockets > 0 && !st.Stalled
	st.WatchClock = clockRunning(p.ClockTick, monotonicNow())
	if c.Flags&flagTarget4 != 0 {
		var b [4]byte
		binary.NativeEndian.PutUint32(b[:], c.Target4)
		st.Target4 = netip.AddrPortFrom(netip.AddrFrom4(b), c.BasePort)
	}
	if c.Flags&flagTarget6 != 0 {
		st.Target6 = netip.AddrPortFrom(wordsAddr(c.Target6), c.BasePort)
	}
	st.CaptureAll = c.Flags&flagCaptureAll != 0
	st.CaptureLoopback = c.Flags&flagCaptureLoopback != 0
	st.UpstreamMark = c.UpstreamMark
	for i := 0; i < int(c.NumSlots); i++ {
		st.SlotPorts = append(st.SlotPorts, c.BasePort+uint16(i))
	}
	var (
		nsKey redirectNsKey
		slot  uint32
	)
	nit := nsMap.Iterate()
	for nit.Next(&nsKey, &slot) {
		st.Nameservers = append(st.Nameservers, NameserverSlot{
			Address: wordsAddr(nsKey.Addr).Unmap(), Slot: int(slot), Port: c.BasePort + uint16(slot),
		})
	}
	if err := nit.Err(); err != nil {
		return nil, fmt.Errorf("read nameservers map: %w", err)
	}
	sort.Slice(st.Nameservers, func(i, j int) bool { return st.Nameservers[i].Slot < st.Nameservers[j].Slot })
	var uid, one uint32
	uit := uidMap.Iterate()
	for uit.Next(&uid, &one) {
		st.ProxyUIDs = append(st.ProxyUIDs, uid)
	}
	if err := uit.Err(); err != nil {
		return nil, fmt.Errorf("read proxy uid map: %w", err)
	}
	sort.Slice(st.ProxyUIDs, func(i, j int) bool { return st.ProxyUIDs[i] < st.ProxyUIDs[j] })

	progs, err := pinnedPrograms(pinDir)
	if err != nil {
		return nil, err
	}
	st.Programs = progs
	if st.Backends, err = countBackends(pinDir); err != nil {
		return nil, err
	}
	st.readCgroupPrograms()
	if st.CgroupProgramsError == "" && len(st.Programs) > 0 {
		st.Capture = HookCaptures(st.CgroupPrograms, st.Backends)
	}
	return st, nil
}

// readCgroupPrograms lists what runs on the capture cgroup (the cgroup of the
// pinned links) beside our pinned programs.
func (st *Status) readCgroupPrograms() {
	cgroup := ""
	for _, p := range st.Programs {
		if cgroup == "" && filepath.IsAbs(p.Cgroup) {
			cgroup = p.Cgroup
		}
	}
	if cgroup == "" {
		if len(st.Programs) > 0 {
			st.CgroupProgramsError = "the capture cgroup of the pinned links was not found"
		}
		return
	}
	progs, err := QueryCgroupPrograms(cgroup, ourIDs(st.Programs))
	if err != nil {
		st.CgroupProgramsError = err.Error()
		return
	}
	st.CgroupPrograms = progs
}

// pinnedPrograms describes the links pinned under pinDir/links, in hook order.
func pinnedPrograms(pinDir string) ([]ProgramInfo, error) {
	var out []ProgramInfo
	var cgIDs []uint64
	type pending struct {
		idx  int
		cgID uint64
	}
	var resolve []pending
	for _, h := range hooks {
		p := filepath.Join(pinDir, linksDir, h.name)
		l, err := link.LoadPinnedLink(p, nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open pinned link %s: %w", p, err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			return nil, fmt.Errorf("read info of pinned link %s: %w", p, err)
		}
		pi := ProgramInfo{Hook: h.name, ProgramID: uint32(info.Program), LinkID: uint32(info.ID)}
		if cg := info.Cgroup(); cg != nil {
			resolve = append(resolve, pending{len(out), cg.CgroupId})
			cgIDs = append(cgIDs, cg.CgroupId)
		}
		out = append(out, pi)
	}
	paths := cgroup2.Walk(cgIDs)
	for _, r := range resolve {
		if p, ok := paths[r.cgID]; ok {
			out[r.idx].Cgroup = p
		} else {
			out[r.idx].Cgroup = fmt.Sprintf("cgroup id %d (not found)", r.cgID)
		}
	}
	return out, nil
}

func wordsAddr(w [4]uint32) netip.Addr {
	var b [16]byte
	for i := range w {
		binary.NativeEndian.PutUint32(b[4*i:], w[i])
	}
	return netip.AddrFrom16(b)
}

// WriteText writes the status in a human-readable form.
func (s *Status) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "pin dir:\t%s\n", s.PinDir)
	fmt.Fprintf(tw, "capturing:\t%v\n", s.Capturing)
	fmt.Fprintf(tw, "resolver sockets:\t%d\n", s.ResolverSockets)
	fmt.Fprintf(tw, "resolver dequeued:\t%d\n", s.Dequeued)
	stall := "no"
	if s.Stalled {
		stall = fmt.Sprintf("yes: nothing dequeued for %s (limit %s)", s.WatchAge.Round(time.Millisecond), s.StallAfter)
	}
	fmt.Fprintf(tw, "stalled:\t%s\n", stall)
	clock := "running (a look at progress every 10ms)"
	if !s.WatchClock {
		clock = "not running (no BPF timers before Linux 5.15, or no agent)"
	}
	fmt.Fprintf(tw, "watch clock:\t%s\n", clock)
	if s.Target4.IsValid() {
		fmt.Fprintf(tw, "target4:\t%s\n", s.Target4)
	}
	if s.Target6.IsValid() {
		fmt.Fprintf(tw, "target6:\t%s\n", s.Target6)
	}
	fmt.Fprintf(tw, "slot ports:\t%v\n", s.SlotPorts)
	for _, ns := range s.Nameservers {
		fmt.Fprintf(tw, "nameserver:\t%s -> slot %d (port %d)\n", ns.Address, ns.Slot, ns.Port)
	}
	fmt.Fprintf(tw, "capture all:\t%v\n", s.CaptureAll)
	fmt.Fprintf(tw, "capture loopback:\t%v\n", s.CaptureLoopback)
	fmt.Fprintf(tw, "upstream mark:\t%#x\n", s.UpstreamMark)
	fmt.Fprintf(tw, "proxy uids:\t%v\n", s.ProxyUIDs)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "HOOK\tPROGRAM ID\tLINK ID\tCGROUP")
	for _, p := range s.Programs {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", p.Hook, p.ProgramID, p.LinkID, p.Cgroup)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if err := writeHookCaptures(w, s.Capture, s.Backends); err != nil {
		return err
	}
	return writeCgroupPrograms(w, s.CgroupPrograms, s.CgroupProgramsError)
}

// countBackends counts the entries of the pinned backends map; 0 when the pin
// is missing (a pin directory of a version without it).
func countBackends(pinDir string) (int, error) {
	name := redirectMapBackends
	if _, err := os.Stat(filepath.Join(pinDir, mapsDir, name)); errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	m, err := loadPinnedMap(pinDir, name)
	if err != nil {
		return 0, err
	}
	defer m.Close()
	n := 0
	it := m.Iterate()
	var (
		k redirectNsKey
		v redirectBackend
	)
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		return 0, fmt.Errorf("read %s map: %w", name, err)
	}
	return n, nil
}
