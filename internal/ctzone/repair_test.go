package ctzone

import (
	"net/netip"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/ctzone/ctzonetest"
)

// TestRepairFlushesStaleEntries: while the nat rules are gone, captured queries
// get zone entries without NAT and reach the upstream; after the rules are back
// those entries keep misrouting their 4-tuples until they are flushed. Check
// (what Run calls) repairs and flushes, so the next queries are all right.
func TestRepairFlushesStaleEntries(t *testing.T) {
	tp := ctzonetest.NewTopology(t, 40000, 40007)
	cfg := Config{
		ListenAddr:  ctzonetest.ProxyListen,
		Nameservers: []netip.Addr{tp.Nameserver},
		ProxyUIDs:   []uint32{ctzonetest.ProxyUID},
		Logger:      testLogger(t),
	}
	var r *Rules
	if err := tp.Pod.Do(func() (err error) { r, err = install(cfg); return err }); err != nil {
		t.Fatalf("install: %v", err)
	}
	t.Cleanup(func() { _ = r.Close() })
	tp.StartProxy(t, ctzonetest.ProxyOptions{UID: ctzonetest.ProxyUID, GID: ctzonetest.ProxyUID})
	run := func(what string) ctzonetest.Result {
		res := tp.RunApp(t, ctzonetest.AppOptions{Mesh: 300, Timeout: 300 * time.Millisecond})
		t.Logf("%s: %s", what, res)
		return res
	}
	if res := run("installed"); res.Misrouted != 0 || res.MeshOK != res.Mesh {
		t.Fatalf("misrouted with the rules in place: %s", res)
	}

	ipt := "iptables-" + r.Backend()
	// Break the nat rules and let the existing (correct) entries go, as a
	// restart or 30 s of idleness would.
	breakNAT := func() {
		tp.Pod.Exec(t, ipt, "-w", "-t", "nat", "-D", "OUTPUT", "-m", "comment", "--comment", commentTag, "-j", chainOutput)
		if err := r.ns.do(func() error { _, err := flushZones([]uint16{r.Zone()}, nil); return err }); err != nil {
			t.Fatal(err)
		}
	}
	breakNAT()
	if res := run("nat jump deleted"); res.Misrouted == 0 {
		t.Fatalf("no query misrouted without the nat rules: the test tests nothing: %s", res)
	}
	// Put the rules back without the flush: the stale zone entries misroute.
	if err := r.ns.do(r.applyAll); err != nil {
		t.Fatalf("reapply: %v", err)
	}
	if res := run("rules back, not flushed"); res.Misrouted == 0 {
		t.Fatalf("no stale entry misrouted a query: the flush below proves nothing: %s", res)
	}
	// Break it again and let Check repair and flush.
	breakNAT()
	if res := run("nat jump deleted again"); res.Misrouted == 0 {
		t.Fatalf("no query misrouted without the nat rules: %s", res)
	}
	var stale int
	if err := r.ns.do(func() error {
		st, err := ReadConntrackStatus()
		if err == nil {
			z := st.Zone(r.Zone(), "udp")
			stale = z.Entries - z.NATed
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if stale == 0 {
		t.Fatalf("no un-NATed entries in zone %d", r.Zone())
	}
	repaired, err := r.Check()
	if err != nil || len(repaired) == 0 {
		t.Fatalf("Check: repaired %q, err %v", repaired, err)
	}
	t.Logf("repaired: %q (%d stale entries in our zone before)", repaired, stale)
	if res := run("repaired and flushed"); res.Misrouted != 0 || res.MeshOK != res.Mesh {
		t.Fatalf("misrouted after the repair: %s", res)
	}
}
