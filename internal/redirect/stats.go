package redirect

import (
	"encoding/binary"
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
)

// HookStats are the counters of one program (or their total), summed over CPUs.
type HookStats struct {
	Hook            string `json:"hook"`
	RedirectedUDP   uint64 `json:"redirected_udp"`
	RedirectedTCP   uint64 `json:"redirected_tcp"`
	ReplyRewritten  uint64 `json:"reply_rewritten"`
	SkipProxy       uint64 `json:"skip_proxy"`
	SkipResolver    uint64 `json:"skip_resolver"`
	SkipNotReady    uint64 `json:"skip_not_ready"`
	SkipNotCaptured uint64 `json:"skip_not_captured"`
	SkipLoopback    uint64 `json:"skip_loopback"`
	SkipOtherNetns  uint64 `json:"skip_other_netns"`
	MapMiss         uint64 `json:"map_miss"`
	MapError        uint64 `json:"map_error"`
}

// counter returns the field of counter i (the order of counterNames).
func (h *HookStats) counter(i int) *uint64 {
	return [...]*uint64{
		&h.RedirectedUDP, &h.RedirectedTCP, &h.ReplyRewritten, &h.SkipProxy, &h.SkipResolver,
		&h.SkipNotReady, &h.SkipNotCaptured, &h.SkipLoopback, &h.SkipOtherNetns, &h.MapMiss, &h.MapError,
	}[i]
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

func (c *CgroupStats) counter(i int) *uint64 {
	return [...]*uint64{&c.RedirectedUDP, &c.RedirectedTCP, &c.ReplyRewritten, &c.Skipped}[i]
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

// ReadStats reads the counters from the maps pinned under pinDir.
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

	s := &Stats{Total: HookStats{Hook: "TOTAL"}}
	for i, h := range hooks {
		var perCPU []redirectHookCounters
		if err := statsMap.Lookup(uint32(i), &perCPU); err != nil {
			return nil, fmt.Errorf("read counters of %s: %w", h.name, err)
		}
		hs := HookStats{Hook: h.name}
		for _, c := range perCPU {
			for j := range counterNames {
				*hs.counter(j) += c.Counters[j]
				*s.Total.counter(j) += c.Counters[j]
			}
		}
		s.Hooks = append(s.Hooks, hs)
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
			for j := range cgroupCounterNames {
				*cs.counter(j) += c.Counters[j]
			}
		}
		s.Cgroups = append(s.Cgroups, cs)
		ids = append(ids, id)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read per-cgroup counters: %w", err)
	}
	paths := cgroupPaths(ids)
	for i := range s.Cgroups {
		s.Cgroups[i].Path = paths[s.Cgroups[i].ID]
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
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	head := []string{"HOOK"}
	for _, n := range counterNames {
		head = append(head, strings.ToUpper(n))
	}
	fmt.Fprintln(tw, strings.Join(head, "\t"))
	row := func(h HookStats) {
		cols := []string{h.Hook}
		for j := range counterNames {
			cols = append(cols, fmt.Sprint(*h.counter(j)))
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
	for _, n := range cgroupCounterNames {
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
		for j := range cgroupCounterNames {
			cols = append(cols, fmt.Sprint(*c.counter(j)))
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
	Ready           bool             `json:"ready"`
	HeartbeatAge    time.Duration    `json:"heartbeat_age_ns"`
	Capturing       bool             `json:"capturing"` // ready and heartbeat fresh
	Target4         netip.AddrPort   `json:"target4"`
	Target6         netip.AddrPort   `json:"target6"`
	SlotPorts       []uint16         `json:"slot_ports"`
	Nameservers     []NameserverSlot `json:"nameservers"`
	CaptureAll      bool             `json:"capture_all"`
	CaptureLoopback bool             `json:"capture_loopback"`
	UpstreamMark    uint32           `json:"upstream_mark"`
	ProxyUIDs       []uint32         `json:"proxy_uids"`
}

// ReadStatus reads what is attached and how it is configured from the links and
// maps pinned under pinDir.
func ReadStatus(pinDir string) (*Status, error) {
	cfgMap, err := loadPinnedMap(pinDir, redirectMapConfig)
	if err != nil {
		return nil, err
	}
	defer cfgMap.Close()
	stateMap, err := loadPinnedMap(pinDir, redirectMapState)
	if err != nil {
		return nil, err
	}
	defer stateMap.Close()
	nsMap, err := loadPinnedMap(pinDir, redirectMapNameservers)
	if err != nil {
		return nil, err
	}
	defer nsMap.Close()
	uidMap, err := loadPinnedMap(pinDir, redirectMapProxyUids)
	if err != nil {
		return nil, err
	}
	defer uidMap.Close()

	st := &Status{PinDir: pinDir}
	var c redirectMeshdnsConfig
	if err := cfgMap.Lookup(uint32(0), &c); err != nil {
		return nil, fmt.Errorf("read config map: %w", err)
	}
	var state redirectMeshdnsState
	if err := stateMap.Lookup(uint32(0), &state); err != nil {
		return nil, fmt.Errorf("read state map: %w", err)
	}
	st.Ready = state.Ready != 0
	if now := monotonicNow(); state.HeartbeatNs != 0 && now >= state.HeartbeatNs {
		st.HeartbeatAge = time.Duration(now - state.HeartbeatNs)
	}
	st.Capturing = st.Ready && st.HeartbeatAge <= HeartbeatTimeout
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
		key  redirectNsKey
		slot uint32
	)
	it := nsMap.Iterate()
	for it.Next(&key, &slot) {
		st.Nameservers = append(st.Nameservers, NameserverSlot{
			Address: wordsAddr(key.Addr).Unmap(), Slot: int(slot), Port: c.BasePort + uint16(slot),
		})
	}
	if err := it.Err(); err != nil {
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
	return st, nil
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
	paths := cgroupPaths(cgIDs)
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
	fmt.Fprintf(tw, "ready:\t%v\n", s.Ready)
	fmt.Fprintf(tw, "heartbeat age:\t%s\n", s.HeartbeatAge.Round(time.Millisecond))
	fmt.Fprintf(tw, "capturing:\t%v\n", s.Capturing)
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
	return tw.Flush()
}
