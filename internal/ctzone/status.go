package ctzone

import (
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
)

// ZoneEntries counts the port-53 conntrack entries (original destination port
// 53) of one zone and protocol.
type ZoneEntries struct {
	Zone      uint16
	Proto     string // "udp" or "tcp"
	Entries   int
	NATed     int // destination-NATed (captured) entries
	Unreplied int // entries that never saw a reply; many of them point at asymmetric zone rules
}

// CPUStat is the kernel's conntrack statistics of one CPU (CPU -1: the sum).
type CPUStat struct {
	CPU           int
	Found         uint64
	Invalid       uint64
	Ignore        uint64
	Insert        uint64
	InsertFailed  uint64
	Drop          uint64
	EarlyDrop     uint64
	Error         uint64
	SearchRestart uint64
}

func (s *CPUStat) add(o CPUStat) {
	s.Found += o.Found
	s.Invalid += o.Invalid
	s.Ignore += o.Ignore
	s.Insert += o.Insert
	s.InsertFailed += o.InsertFailed
	s.Drop += o.Drop
	s.EarlyDrop += o.EarlyDrop
	s.Error += o.Error
	s.SearchRestart += o.SearchRestart
}

// ConntrackStatus is what `meshdns-ebpf status` shows of conntrack.
type ConntrackStatus struct {
	Zones      []ZoneEntries // sorted by zone, then protocol
	Stats      []CPUStat     // per CPU
	Total      CPUStat       // the sum of Stats (CPU -1)
	Entries    int           // all entries in the table
	MaxEntries int
}

// Zone returns the counts of one zone and protocol (zero counts if none).
func (s *ConntrackStatus) Zone(zone uint16, proto string) ZoneEntries {
	for _, z := range s.Zones {
		if z.Zone == zone && z.Proto == proto {
			return z
		}
	}
	return ZoneEntries{Zone: zone, Proto: proto}
}

// WriteTable writes the status as aligned tables with upper-case headers.
func (s *ConntrackStatus) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ZONE\tPROTO\tPORT53_ENTRIES\tNATED\tUNREPLIED")
	if len(s.Zones) == 0 {
		fmt.Fprintln(tw, "-\t-\t0\t0\t0")
	}
	for _, z := range s.Zones {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\n", z.Zone, z.Proto, z.Entries, z.NATed, z.Unreplied)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CPU\tFOUND\tINVALID\tIGNORE\tINSERT\tINSERT_FAILED\tDROP\tEARLY_DROP\tERROR\tSEARCH_RESTART")
	row := func(name string, c CPUStat) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", name, c.Found, c.Invalid, c.Ignore, c.Insert,
			c.InsertFailed, c.Drop, c.EarlyDrop, c.Error, c.SearchRestart)
	}
	for _, c := range s.Stats {
		row(strconv.Itoa(c.CPU), c)
	}
	row("total", s.Total)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CONNTRACK_ENTRIES\tCONNTRACK_MAX")
	fmt.Fprintf(tw, "%d\t%d\n", s.Entries, s.MaxEntries)
	return tw.Flush()
}
