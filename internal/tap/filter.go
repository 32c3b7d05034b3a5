package tap

import (
	"fmt"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/miekg/dns"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Filter selects the events a subscriber gets. Empty fields select
// everything. The query fields are checked as the event is published, so a
// narrow subscription takes no room in its ring for the rest; the workload
// fields once the sender is named.
type Filter struct {
	Namespace string // the pod's namespace
	Pod       string // the pod's name, or a glob (web-*)
	Cgroup    string // the cgroup path, or a glob (/system.slice/*)
	Suffix    string // query names equal to this or under it (FQDN, lower case)
	Qtypes    []uint16
	Rcodes    []int
	Answers   []Answer
	// MinLatency keeps only answers that took at least this long.
	MinLatency time.Duration
	// Unanswered keeps only queries that got no answer in time (Shed, Failed).
	Unanswered bool
}

// matchEvent checks the fields known when the event is published.
func (f *Filter) matchEvent(ev *Event) bool {
	if f.Unanswered && !ev.Answer.Unanswered() {
		return false
	}
	if ev.Latency < int64(f.MinLatency) {
		return false
	}
	if len(f.Answers) > 0 && !slices.Contains(f.Answers, ev.Answer) {
		return false
	}
	if len(f.Qtypes) > 0 && !slices.Contains(f.Qtypes, ev.Qtype) {
		return false
	}
	if len(f.Rcodes) > 0 && !slices.Contains(f.Rcodes, int(ev.Rcode)) {
		return false
	}
	return f.Suffix == "" || ev.hasSuffix(f.Suffix)
}

// MatchIdentity checks the workload fields.
func (f *Filter) MatchIdentity(id workload.Identity) bool {
	if f.Namespace != "" && id.Namespace != f.Namespace {
		return false
	}
	if f.Pod != "" && !glob(f.Pod, id.Pod) {
		return false
	}
	return f.Cgroup == "" || glob(f.Cgroup, id.Cgroup) || strings.HasPrefix(id.Cgroup, strings.TrimSuffix(f.Cgroup, "/")+"/")
}

func glob(pattern, s string) bool {
	if pattern == s {
		return true
	}
	ok, err := path.Match(pattern, s)
	return err == nil && ok
}

// Values encodes f as query parameters (what the CLI sends to /debug/tap).
func (f Filter) Values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set("namespace", f.Namespace)
	set("pod", f.Pod)
	set("cgroup", f.Cgroup)
	set("suffix", f.Suffix)
	for _, t := range f.Qtypes {
		v.Add("qtype", dns.Type(t).String())
	}
	for _, r := range f.Rcodes {
		v.Add("rcode", dns.RcodeToString[r])
	}
	for _, a := range f.Answers {
		v.Add("answer", a.String())
	}
	if f.MinLatency > 0 {
		set("min-latency", f.MinLatency.String())
	}
	if f.Unanswered {
		set("unanswered", "true")
	}
	return v
}

// ParseFilter reads what Values wrote. Lists may also be given comma-separated
// (qtype=A,AAAA).
func ParseFilter(v url.Values) (Filter, error) {
	f := Filter{Namespace: v.Get("namespace"), Pod: v.Get("pod"), Cgroup: v.Get("cgroup")}
	if s := v.Get("suffix"); s != "" {
		f.Suffix = dns.CanonicalName(s)
	}
	for _, s := range list(v["qtype"]) {
		t, ok := dns.StringToType[strings.ToUpper(s)]
		if !ok {
			return f, fmt.Errorf("qtype %q: not a query type", s)
		}
		f.Qtypes = append(f.Qtypes, t)
	}
	for _, s := range list(v["rcode"]) {
		r, ok := dns.StringToRcode[strings.ToUpper(s)]
		if !ok {
			return f, fmt.Errorf("rcode %q: not a response code", s)
		}
		f.Rcodes = append(f.Rcodes, r)
	}
	for _, s := range list(v["answer"]) {
		a, ok := ParseAnswer(s)
		if !ok {
			return f, fmt.Errorf("answer %q: want one of %s (or refused, stale)", s, strings.Join(answerNames[:], ", "))
		}
		f.Answers = append(f.Answers, a)
	}
	if s := v.Get("min-latency"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d < 0 {
			return f, fmt.Errorf("min-latency %q: want a duration such as 50ms", s)
		}
		f.MinLatency = d
	}
	if s := v.Get("unanswered"); s != "" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return f, fmt.Errorf("unanswered %q: want true or false", s)
		}
		f.Unanswered = b
	}
	return f, nil
}

// list splits comma-separated values.
func list(vs []string) []string {
	var out []string
	for _, v := range vs {
		for s := range strings.SplitSeq(v, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
	}
	return out
}
