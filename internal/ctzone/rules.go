//go:build linux

package ctzone

import (
	"fmt"
	"net/netip"
	"strconv"
)

// Chain names. The same names are used in the nat and raw tables.
const (
	chainOutput     = chainPrefix + "OUTPUT"
	chainPrerouting = chainPrefix + "PREROUTING"
)

// chainSpec is one chain of ours: its table, the built-in chain that jumps to
// it (with one rule, inserted first), and its rules (iptables arguments after
// "-A CHAIN").
type chainSpec struct {
	table string
	name  string
	hook  string
	rules [][]string
}

// tableSpec is every chain of ours in one table of one family.
type tableSpec struct {
	v6     bool
	table  string
	chains []chainSpec
}

func hostPrefix(a netip.Addr) string {
	if a.Is4() {
		return a.String() + "/32"
	}
	return a.String() + "/128"
}

func loopbackNet(v6 bool) string {
	if v6 {
		return "::1/128"
	}
	return "127.0.0.0/8"
}

func portRange(lo, hi uint16) string {
	if lo == hi {
		return strconv.Itoa(int(lo))
	}
	return fmt.Sprintf("%d:%d", lo, hi)
}

func natTarget(listen netip.Addr, port uint16) []string {
	return []string{"-j", "DNAT", "--to-destination", netip.AddrPortFrom(listen, port).String()}
}

// exclusions are the RETURN rules for sockets we never capture: the resolver's
// upstream sockets (mark) and the proxies (owner). They only work in OUTPUT.
func (n *normalized) exclusions() [][]string {
	rules := [][]string{{"-m", "mark", "--mark", fmt.Sprintf("0x%x", n.UpstreamMark), "-j", "RETURN"}}
	for _, uid := range n.ProxyUIDs {
		rules = append(rules, []string{"-m", "owner", "--uid-owner", strconv.FormatUint(uint64(uid), 10), "-j", "RETURN"})
	}
	for _, gid := range n.ProxyGIDs {
		rules = append(rules, []string{"-m", "owner", "--gid-owner", strconv.FormatUint(uint64(gid), 10), "-j", "RETURN"})
	}
	return rules
}

// captureNAT are the DNAT rules of one family: UDP and TCP port 53 to each
// captured nameserver go to its slot port; with capture-all everything else
// (but loopback) goes to the capture-all slot.
func captureNAT(f family) [][]string {
	var rules [][]string
	la := f.listen.Addr()
	for _, s := range f.servers {
		for _, proto := range []string{"udp", "tcp"} {
			rules = append(rules, append([]string{"-d", hostPrefix(s.addr), "-p", proto, "-m", proto, "--dport", "53"}, natTarget(la, s.port)...))
		}
	}
	if f.all {
		rules = append(rules, []string{"-d", loopbackNet(f.v6), "-j", "RETURN"})
		for _, proto := range []string{"udp", "tcp"} {
			rules = append(rules, append([]string{"-p", proto, "-m", proto, "--dport", "53"}, natTarget(la, f.allPort)...))
		}
	}
	return rules
}

// captureZone are the raw rules that put the captured UDP requests in our zone;
// they mirror captureNAT exactly (same destinations, loopback excluded).
func (n *normalized) captureZone(f family) [][]string {
	zone := []string{"-j", "CT", "--zone", strconv.Itoa(int(n.Zone))}
	var rules [][]string
	for _, s := range f.servers {
		rules = append(rules, append([]string{"-d", hostPrefix(s.addr), "-p", "udp", "-m", "udp", "--dport", "53"}, zone...))
	}
	if f.all {
		rules = append(rules, []string{"-d", loopbackNet(f.v6), "-j", "RETURN"})
		rules = append(rules, append([]string{"-p", "udp", "-m", "udp", "--dport", "53"}, zone...))
	}
	return rules
}

// tables returns every table of ours for both families, in install order: nat
// before raw, so a captured flow never gets a zone entry without its NAT (such
// an entry would send the next query of that 4-tuple past the resolver).
// A family that captures nothing has no tables.
func (n *normalized) tables() []tableSpec {
	var out []tableSpec
	for _, f := range n.fams {
		if !f.captures() {
			continue
		}
		out = append(out, n.natTable(f), n.rawTable(f))
	}
	return out
}

func (n *normalized) natTable(f family) tableSpec {
	la := hostPrefix(f.listen.Addr())
	t := tableSpec{v6: f.v6, table: "nat"}
	// Local processes: everything but the resolver's upstream sockets and the
	// proxies; queries already addressed to the resolver are left alone.
	out := [][]string{{"-d", la, "-j", "RETURN"}}
	out = append(out, n.exclusions()...)
	out = append(out, captureNAT(f)...)
	t.chains = append(t.chains, chainSpec{table: "nat", name: chainOutput, hook: "OUTPUT", rules: out})
	if f.podCapture() {
		pre := [][]string{{"-d", la, "-j", "RETURN"}}
		pre = append(pre, captureNAT(f)...)
		t.chains = append(t.chains, chainSpec{table: "nat", name: chainPrerouting, hook: "PREROUTING", rules: pre})
	}
	return t
}

// rawTable puts every UDP flow whose server side is our resolver — captured
// (NATed) flows and queries addressed to the resolver directly — in our zone,
// in both directions, and leaves every other flow (the resolver's and proxies'
// upstream queries and their replies, uncaptured port-53 traffic) in its
// default zone, also in both directions:
//
//   - request of a flow to the resolver, from a local process: OUTPUT, -d listen
//   - request from another namespace (pod): PREROUTING, -d listen / captured -d
//   - reply of the resolver: OUTPUT, -s listen --sport slots (it restores the
//     original destination as reply source: the NAT entry must be found)
//   - captured request of a local process: OUTPUT, after the exclusions
//
// The CT target is first-match (a packet that already has a conntrack template
// or entry is left alone) and is not terminating, so the exclusions RETURN
// before the generic rules can match, and nothing else needs ordering. Replies
// arriving from an upstream carry no rule: they stay in the default zone with
// their requests. TCP is not zoned: a new SYN on a TIME_WAIT 4-tuple starts a
// fresh conntrack entry (and NAT decision), so TCP does not suffer the bug.
func (n *normalized) rawTable(f family) tableSpec {
	la := hostPrefix(f.listen.Addr())
	zone := []string{"-j", "CT", "--zone", strconv.Itoa(int(n.Zone))}
	slots := portRange(f.minPort, f.maxPort)
	t := tableSpec{v6: f.v6, table: "raw"}
	out := [][]string{
		append([]string{"-d", la, "-p", "udp", "-m", "udp", "--dport", slots}, zone...),
		append([]string{"-s", la, "-p", "udp", "-m", "udp", "--sport", slots}, zone...),
	}
	out = append(out, n.exclusions()...)
	out = append(out, n.captureZone(f)...)
	t.chains = append(t.chains, chainSpec{table: "raw", name: chainOutput, hook: "OUTPUT", rules: out})
	if f.podCapture() {
		pre := [][]string{append([]string{"-d", la, "-p", "udp", "-m", "udp", "--dport", slots}, zone...)}
		pre = append(pre, n.captureZone(f)...)
		t.chains = append(t.chains, chainSpec{table: "raw", name: chainPrerouting, hook: "PREROUTING", rules: pre})
	}
	return t
}

// jumpRule is the rule in a built-in chain that enters one of ours.
func jumpRule(chain string) []string {
	return []string{"-m", "comment", "--comment", commentTag, "-j", chain}
}
