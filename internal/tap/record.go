package tap

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Record is one line of the stream /debug/tap sends (newline-delimited
// JSON), and of `meshdns-ebpf tap -o json`. A line with only Lost set is a
// notice: the subscriber lost that many records since the last notice
// because it read too slowly.
type Record struct {
	Time time.Time `json:"time,omitzero"`
	workload.Identity
	Client    string  `json:"client,omitempty"` // source address and port
	Proto     string  `json:"proto,omitempty"`
	Qname     string  `json:"qname,omitempty"`
	Qtype     string  `json:"qtype,omitempty"`
	Rcode     string  `json:"rcode,omitempty"`
	Answer    string  `json:"answer,omitempty"`   // see Answer: table, autopath, cache, upstream, fallback, shed, failed, error
	Upstream  string  `json:"upstream,omitempty"` // the upstream that answered (upstream, fallback)
	Dst       string  `json:"dst,omitempty"`      // an egress decision's destination (denied, audited)
	LatencyUS float64 `json:"latency_us,omitempty"`
	Size      int     `json:"size,omitempty"` // bytes of the answer
	Lost      uint64  `json:"lost,omitempty"`
}

// appendRecord appends ev as one JSON line, with its sender's fields as
// appendIdentity wrote them (once per sender, not per record): by hand,
// because a busy node publishes tens of thousands a second.
func appendRecord(b []byte, ev *Event, identity []byte) []byte {
	b = append(b, `{"time":"`...)
	b = time.Unix(0, ev.Time).UTC().AppendFormat(b, time.RFC3339Nano)
	b = append(b, '"')
	b = append(b, identity...)
	if ev.Key.Addr.IsValid() {
		b = append(b, `,"client":"`...)
		b = netip.AddrPortFrom(ev.Key.Addr, ev.Port).AppendTo(b)
		b = append(b, '"')
	}
	if ev.TCP {
		b = append(b, `,"proto":"tcp"`...)
	} else {
		b = append(b, `,"proto":"udp"`...)
	}
	b = appendField(b, "qname", ev.Name())
	if ev.Answer.Egress() {
		b = appendField(b, "answer", ev.Answer.String())
		b = append(b, `,"dst":"`...)
		b = ev.Dst.AppendTo(b)
		return append(b, "\"}\n"...)
	}
	b = appendField(b, "qtype", dns.Type(ev.Qtype).String())
	b = appendField(b, "rcode", rcodeName(int(ev.Rcode)))
	b = appendField(b, "answer", ev.Answer.String())
	if ev.Upstream.IsValid() {
		b = append(b, `,"upstream":"`...)
		b = ev.Upstream.AppendTo(b)
		b = append(b, '"')
	}
	b = append(b, `,"latency_us":`...)
	b = strconv.AppendFloat(b, float64(ev.Latency)/1e3, 'f', 1, 64)
	b = appendNumber(b, "size", uint64(ev.Size))
	return append(b, "}\n"...)
}

// appendIdentity appends the fields of a record that name its sender, each
// with its leading comma.
func appendIdentity(b []byte, id *workload.Identity) []byte {
	b = appendField(b, "workload", id.Workload)
	b = appendField(b, "namespace", id.Namespace)
	b = appendField(b, "pod", id.Pod)
	b = appendField(b, "container", id.Container)
	b = appendField(b, "cgroup", id.Cgroup)
	b = appendNumber(b, "cgroup_id", id.CgroupID)
	b = appendNumber(b, "pid", uint64(id.PID))
	return appendField(b, "by", id.By)
}

// appendField appends ,"k":"v" unless v is empty.
func appendField(b []byte, k, v string) []byte {
	if v == "" {
		return b
	}
	b = append(b, `,"`...)
	b = append(b, k...)
	b = append(b, `":`...)
	return appendString(b, v)
}

// appendNumber appends ,"k":v unless v is 0.
func appendNumber(b []byte, k string, v uint64) []byte {
	if v == 0 {
		return b
	}
	b = append(b, `,"`...)
	b = append(b, k...)
	b = append(b, `":`...)
	return strconv.AppendUint(b, v, 10)
}

// appendString appends s as a JSON string: as it is when it is printable
// ASCII without quotes or backslashes (query names and paths nearly always
// are), else escaped as encoding/json does (invalid UTF-8 becomes U+FFFD).
func appendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

func rcodeName(rc int) string {
	if s, ok := dns.RcodeToString[rc]; ok {
		return s
	}
	return "RCODE" + strconv.Itoa(rc)
}

func appendLost(b []byte, n uint64) []byte {
	b = append(b, `{"lost":`...)
	b = strconv.AppendUint(b, n, 10)
	return append(b, "}\n"...)
}

// Streaming: what a subscriber's connection does.
const (
	flushEvery   = 50 * time.Millisecond // how often a subscriber's ring is drained and sent
	writeTimeout = 30 * time.Second      // a reader stuck longer is disconnected
	batchMax     = 4096                  // records per flush at most
)

// Handler serves /debug/tap: it subscribes with the filter of the query
// parameters (ParseFilter) and streams records until the client goes away.
// name names each event's sender (workload.Namer.Name).
func (h *Hub) Handler(name func(workload.Key) workload.Identity, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f, err := ParseFilter(r.URL.Query())
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		sub, err := h.Subscribe(f)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer sub.Close()
		rc := http.NewResponseController(w)
		w.Header().Set("Content-Type", "application/x-ndjson")
		w.WriteHeader(http.StatusOK)
		_ = rc.Flush()
		log.Debug("tap subscriber", "remote", r.RemoteAddr, "filter", r.URL.RawQuery)
		stream(r, rc, w, sub, name)
	})
}

// stream drains sub every flushEvery and writes what it holds.
func stream(r *http.Request, rc *http.ResponseController, w io.Writer, sub *Sub, name func(workload.Key) workload.Identity) {
	t := time.NewTicker(flushEvery)
	defer t.Stop()
	f := sub.Filter()
	// This second's senders: named, and their record fields written, once.
	type sender struct {
		id   workload.Identity
		json []byte
	}
	names := map[workload.Key]sender{}
	renamed := time.Now()
	buf := make([]byte, 0, 256<<10)
	var ev Event
	for {
		select {
		case <-r.Context().Done():
			return
		case <-t.C:
		}
		if time.Since(renamed) > time.Second {
			clear(names)
			renamed = time.Now()
		}
		buf = buf[:0]
		for n := 0; n < batchMax && sub.Next(&ev); n++ {
			snd, ok := names[ev.Key]
			if !ok {
				snd.id = name(ev.Key)
				snd.json = appendIdentity(nil, &snd.id)
				names[ev.Key] = snd
			}
			if f.MatchIdentity(snd.id) {
				buf = appendRecord(buf, &ev, snd.json)
			}
		}
		if lost := sub.TakeLost(); lost > 0 {
			buf = appendLost(buf, lost)
		}
		if len(buf) == 0 {
			continue
		}
		_ = rc.SetWriteDeadline(time.Now().Add(writeTimeout))
		if _, err := w.Write(buf); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
	}
}

// Read decodes a stream of records from r and calls fn for each until r ends,
// fn fails, or a line does not decode.
func Read(r io.Reader, fn func(*Record) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var rec Record
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return fmt.Errorf("tap record %q: %w", sc.Text(), err)
		}
		if err := fn(&rec); err != nil {
			return err
		}
	}
	return sc.Err()
}

// TextHeader is the header of WriteText's columns.
const TextHeader = "TIME          WORKLOAD                         QTYPE  RCODE     ANSWER    LATENCY    SIZE   UPSTREAM/DST           QNAME"

// WriteText writes r as one line of fixed-width columns under TextHeader (a
// stream cannot wait for the widest value); long workloads are cut from the
// left, where their least telling part is.
func WriteText(w io.Writer, r *Record) error {
	if r.Lost > 0 {
		_, err := fmt.Fprintf(w, "LOST %d records: this reader was too slow\n", r.Lost)
		return err
	}
	wl := r.Workload
	if r.Container != "" {
		wl += "/" + r.Container
	}
	if len(wl) > 32 {
		wl = "…" + wl[len(wl)-31:]
	}
	up := r.Upstream
	if r.Dst != "" {
		up = r.Dst // an egress decision: where the workload connected
	}
	if up == "" {
		up = "-"
	}
	_, err := fmt.Fprintf(w, "%-13s %-32s %-6s %-9s %-9s %-10s %-6d %-22s %s\n",
		r.Time.Local().Format("15:04:05.000"), wl, r.Qtype, r.Rcode, r.Answer,
		strings.TrimSpace(fmtLatency(r.LatencyUS)), r.Size, up, r.Qname)
	return err
}

func fmtLatency(us float64) string {
	switch {
	case us >= 1e6:
		return strconv.FormatFloat(us/1e6, 'f', 2, 64) + "s"
	case us >= 1e3:
		return strconv.FormatFloat(us/1e3, 'f', 1, 64) + "ms"
	}
	return strconv.FormatFloat(us, 'f', 0, 64) + "µs"
}
