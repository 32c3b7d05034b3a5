// Package tap is the live stream of answered queries behind `meshdns-ebpf
// tap`: the resolver publishes one Event per answer to a Hub; each subscriber
// (an admin connection) has a fixed ring the publisher writes without
// blocking or allocating, and a record it cannot take is dropped and counted
// for that subscriber, which is told how many it lost. With no subscriber,
// publishing is one atomic load.
package tap

import (
	"net/netip"
	"strings"

	"github.com/meshdns/meshdns-ebpf/internal/workload"
)

// Answer says where an answer came from.
type Answer uint8

// Answers. Shed, Failed and Throttled are the unanswered ones: the client got
// no answer to its question in time (REFUSED/SERVFAIL at once over a pending
// bound or its workload's budget, or SERVFAIL after the upstreams failed or
// timed out).
const (
	Table     Answer = iota // the name table (or an authoritative NXDOMAIN under the cluster domain)
	Autopath                // a search-path expansion answered in one response (CNAME to the real name)
	Cache                   // the upstream answer cache
	Upstream                // forwarded to an upstream
	Fallback                // an expired cache entry, served because the upstreams failed
	Shed                    // refused or failed at once: too many queries waiting for the upstream
	Failed                  // no upstream answered in time: SERVFAIL
	Error                   // a malformed or unsupported query: FORMERR, NOTIMP, REFUSED
	Throttled               // refused at once: its workload is over its upstream budget
	// Not answers but egress decisions: a connect or send of a workload an egress
	// policy selects, to Dst, that no grant allowed (Name: the name it was
	// answered for Dst but may not use, or empty when no answer named Dst).
	Denied  // refused with EPERM (enforce)
	Audited // allowed and recorded (audit)
	numAnswers
)

var answerNames = [numAnswers]string{"table", "autopath", "cache", "upstream", "fallback", "shed", "failed", "error", "throttled", "denied", "audited"}

// Egress reports whether the event is an egress decision, not a query.
func (a Answer) Egress() bool { return a == Denied || a == Audited }

func (a Answer) String() string {
	if a < numAnswers {
		return answerNames[a]
	}
	return "unknown"
}

// Unanswered reports whether the client got no answer to its question in time.
func (a Answer) Unanswered() bool { return a == Shed || a == Failed || a == Throttled }

// ParseAnswer parses an answer name; "refused" is Shed, "stale" Fallback and
// "servfail"/"timeout" Failed.
func ParseAnswer(s string) (Answer, bool) {
	switch strings.ToLower(s) {
	case "refused":
		return Shed, true
	case "stale":
		return Fallback, true
	case "servfail", "timeout":
		return Failed, true
	}
	for i, n := range answerNames {
		if strings.EqualFold(n, s) {
			return Answer(i), true
		}
	}
	return 0, false
}

// Event is one answered query. It holds no pointer into the query path's
// buffers: the name is copied in.
type Event struct {
	Time     int64 // unix nanoseconds when the query was received
	Latency  int64 // nanoseconds from receiving it to having its answer
	Key      workload.Key
	Port     uint16 // the client's source port
	Upstream netip.AddrPort
	Qtype    uint16
	Rcode    uint16
	Size     uint16 // bytes of the answer
	Answer   Answer
	TCP      bool
	Dst      netip.AddrPort // egress decisions: the destination
	nameLen  uint8
	name     [255]byte
}

// SetName copies name (an FQDN) into e in lower case, cut at 255 bytes.
func (e *Event) SetName(name string) {
	n := copy(e.name[:], name)
	for i, c := range e.name[:n] {
		if 'A' <= c && c <= 'Z' {
			e.name[i] = c + 'a' - 'A'
		}
	}
	e.nameLen = uint8(n)
}

// Name returns the query name.
func (e *Event) Name() string { return string(e.name[:e.nameLen]) }

// hasSuffix reports whether the name is suffix or ends in "."+suffix (both FQDNs).
func (e *Event) hasSuffix(suffix string) bool {
	n := e.name[:e.nameLen]
	if len(n) < len(suffix) || string(n[len(n)-len(suffix):]) != suffix {
		return false
	}
	return len(n) == len(suffix) || n[len(n)-len(suffix)-1] == '.'
}
