package e2e

import (
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// clientCase is one real resolver asked for one name.
type clientCase struct {
	name string
	argv []string // the client; the queried name is appended
	want func(out string) bool
}

func has(want string) func(string) bool {
	return func(out string) bool {
		for _, l := range strings.Fields(out) {
			if l == want {
				return true
			}
		}
		return false
	}
}

// clientSuite is the suite of real clients: glibc's getent (A and AAAA in
// parallel on one connected socket), Go's pure resolver, dig over UDP and TCP, and a
// musl-linked getaddrinfo. Each accepts an answer only if it comes from the
// nameserver it asked, so a pass also proves the reply source was restored.
func clientSuite() []clientCase {
	var cases []clientCase
	for _, q := range []struct{ name, ip string }{{meshName, meshIP}, {extName, extIP}} {
		cases = append(cases,
			clientCase{"glibc/" + q.name, []string{"getent", "ahosts", q.name}, has(q.ip)},
			clientCase{"go/" + q.name, []string{bins.goresolve, q.name}, has(q.ip)},
			clientCase{"dig-udp/" + q.name, []string{"dig", "+short", "+time=2", "+tries=1", q.name}, has(q.ip)},
			clientCase{"dig-tcp/" + q.name, []string{"dig", "+tcp", "+short", "+time=2", "+tries=1", q.name}, has(q.ip)},
			clientCase{"musl/" + q.name, []string{bins.musl, q.name}, has(q.ip)},
		)
	}
	return cases
}

func runClients(t *testing.T, n *node, ns *testenv.Netns, uid int, cases []clientCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, err := n.client(ns, uid, c.argv[0], c.argv[1:]...)
			if err != nil {
				t.Fatalf("%v", err)
			}
			if !c.want(out) {
				t.Fatalf("%v: unexpected answer:\n%s", c.argv, out)
			}
		})
	}
}

// TestClientsEBPF: in eBPF mode, real clients on the node and in
// a pod resolve a mesh name only our resolver knows and an external name forwarded
// upstream; IPv6 nameservers and v4-mapped destinations are captured too.
func TestClientsEBPF(t *testing.T) {
	n := newNode(t)
	n.start("ebpf")
	t.Run("node", func(t *testing.T) { runClients(t, n, n.ns, 1000, clientSuite()) })
	t.Run("pod", func(t *testing.T) { runClients(t, n, n.pod, 1000, clientSuite()) })
	t.Run("ipv6-nameserver", func(t *testing.T) {
		runClients(t, n, n.pod6, 1000, []clientCase{
			{"dig-udp", []string{"dig", "+short", "+time=2", "+tries=1", "AAAA", meshName6}, has(meshIP6)},
			{"dig-tcp", []string{"dig", "+tcp", "+short", "+time=2", "+tries=1", "AAAA", meshName6}, has(meshIP6)},
			{"glibc", []string{"getent", "ahosts", meshName6}, has(meshIP6)},
			{"musl", []string{bins.musl, meshName}, has(meshIP)},
			{"go", []string{bins.goresolve, extName}, has(extIP)},
		})
	})
	t.Run("v4-mapped", func(t *testing.T) {
		// musl opens one AF_INET6 socket and sends to [fd53::99] (unreachable) and to
		// [::ffff:169.254.53.1]: only the v4-mapped query can be answered.
		before := hookCounter(t, n, "recvmsg6", "reply_rewritten")
		runClients(t, n, n.podMap, 1000, []clientCase{
			{"musl", []string{bins.musl, meshName}, has(meshIP)},
		})
		if after := hookCounter(t, n, "recvmsg6", "reply_rewritten"); after <= before {
			t.Errorf("recvmsg6 reply_rewritten did not grow (%d → %d): the v4-mapped reply was not restored by the v6 hook", before, after)
		}
	})
	if n.orig.Count(meshName) != 0 || n.orig6.Count(meshName) != 0 {
		t.Errorf("the original nameservers saw mesh queries (v4 %d, v6 %d): capture leaked", n.orig.Count(meshName), n.orig6.Count(meshName))
	}
	if n.orig.Count(extName) == 0 {
		t.Errorf("the resolver never forwarded %s upstream", extName)
	}
}

// TestExclusions: a proxy-UID process and the resolver's own
// upstream queries reach the original nameserver; root processes are still
// captured; other destinations are left alone unless --capture-all.
func TestExclusions(t *testing.T) {
	n := newNode(t)
	n.start("ebpf")
	dig := func(uid int, args ...string) string {
		t.Helper()
		out, err := n.client(n.ns, uid, "dig", append([]string{"+time=2", "+tries=1"}, args...)...)
		if err != nil {
			t.Fatalf("dig %v as uid %d: %v", args, uid, err)
		}
		return out
	}
	if out := dig(1337, meshName); !strings.Contains(out, "status: NXDOMAIN") {
		t.Errorf("proxy uid 1337 was captured: want NXDOMAIN from the original nameserver, got:\n%s", out)
	}
	if n.orig.Count(meshName) != 1 {
		t.Errorf("the original nameserver saw %d queries for %s from the proxy uid, want 1", n.orig.Count(meshName), meshName)
	}
	if out := dig(0, "+short", meshName); strings.TrimSpace(out) != meshIP {
		t.Errorf("a root process was not captured: got %q, want %s (running as root must not exempt every root process)", out, meshIP)
	}
	// The agent runs as root in the same cgroup: its upstream query for extName
	// must reach the original nameserver, not loop back into the resolver.
	n.orig.Reset()
	if out := dig(1000, "+short", extName); strings.TrimSpace(out) != extIP {
		t.Errorf("forwarded name: got %q, want %s", out, extIP)
	}
	if n.orig.Count(extName) != 1 {
		t.Errorf("the resolver's upstream query reached the original nameserver %d times, want 1", n.orig.Count(extName))
	}
	if out := dig(1000, "@"+otherNS, meshName); !strings.Contains(out, "status: NXDOMAIN") {
		t.Errorf("dig @%s was captured without --capture-all:\n%s", otherNS, out)
	}
	if n.other.Count(meshName) != 1 {
		t.Errorf("%s saw %d queries, want 1", otherNS, n.other.Count(meshName))
	}

	if err := n.signal(sigterm); err != nil {
		t.Fatalf("agent exit: %v\n%s", err, n.stderr.String())
	}
	n.start("ebpf", "--capture-all")
	n.other.Reset()
	if out := dig(1000, "+short", "@"+otherNS, meshName); strings.TrimSpace(out) != meshIP {
		t.Errorf("dig @%s with --capture-all: got %q, want %s from our resolver", otherNS, out, meshIP)
	}
	if n.other.Count(meshName) != 0 {
		t.Errorf("%s still saw the query with --capture-all", otherNS)
	}
}
