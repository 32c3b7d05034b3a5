package meshsource

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// recordSink is the store's side of a sink as far as the sweeper can
// tell: the keys with hosts, the clients, the sync and health calls.
type recordSink struct {
	hosts   map[string]string
	clients map[string]string
	synced  int
	failed  []string
}

func newRecordSink() *recordSink {
	return &recordSink{hosts: map[string]string{}, clients: map[string]string{}}
}

func (r *recordSink) Set(key string, hosts []nametable.Host) error {
	if len(hosts) == 0 {
		delete(r.hosts, key)
		return nil
	}
	r.hosts[key] = hosts[0].Name
	return nil
}

func (r *recordSink) SetClients(key string, ips []netip.Addr, ns string) error {
	if len(ips) == 0 {
		delete(r.clients, key)
		return nil
	}
	r.clients[key] = ns
	return nil
}

func (r *recordSink) Apply(c *nametable.Change) error {
	for _, e := range c.Set {
		r.hosts[e.Key] = e.Host.Name
	}
	for _, k := range c.Gone {
		delete(r.hosts, k)
	}
	return nil
}

func (r *recordSink) Load(hosts map[string]nametable.Host, clients map[netip.Addr]string) error {
	clear(r.hosts)
	for k, h := range hosts {
		r.hosts[k] = h.Name
	}
	return nil
}

func (r *recordSink) Synced() { r.synced++ }

func (r *recordSink) Audit(expected int) error {
	if len(r.hosts) != expected {
		return fmt.Errorf("have %d objects, want %d", len(r.hosts), expected)
	}
	return nil
}

func (r *recordSink) Failed(err error) {
	if err == nil {
		r.failed = append(r.failed, "ok")
	} else {
		r.failed = append(r.failed, err.Error())
	}
}

func (r *recordSink) keys() string { return strings.Join(slices.Sorted(maps.Keys(r.hosts)), " ") }

func host(name string) []nametable.Host { return []nametable.Host{{Name: name}} }

// A restarted watch (new generation) keeps the old names until it synced,
// then removes exactly what it did not see; calls of a stopped generation
// are dropped.
func TestSweeper(t *testing.T) {
	rec := newRecordSink()
	sw := newSweeper(rec)
	g1 := sw.next()
	_ = g1.Set("ns/a", host("a.example.com"))
	_ = g1.Set("ns/b", host("b.example.com"))
	_ = g1.Set("ns/c", host("c.example.com"))
	_ = g1.Set("ns/c", nil) // deleted while the first generation ran
	_ = g1.SetClients("ns/pod", []netip.Addr{netip.MustParseAddr("10.0.0.1")}, "ns")
	g1.Synced()
	if rec.keys() != "ns/a ns/b" || rec.synced != 1 {
		t.Fatalf("after generation 1: keys %q synced %d", rec.keys(), rec.synced)
	}

	g2 := sw.next()
	// The old generation's late calls are dropped.
	_ = g1.Set("ns/late", host("late.example.com"))
	g1.Failed(errors.New("old watch failing"))
	_ = g2.Set("ns/b", host("b.example.com"))
	_ = g2.Set("ns/d", host("d.example.com"))
	// Until generation 2 synced, ns/a (not seen by it yet) keeps serving.
	if rec.keys() != "ns/a ns/b ns/d" {
		t.Fatalf("before generation 2 synced: keys %q", rec.keys())
	}
	g2.Synced()
	if rec.keys() != "ns/b ns/d" || len(rec.clients) != 0 || rec.synced != 2 || len(rec.failed) != 0 {
		t.Fatalf("after generation 2: keys %q clients %v synced %d failed %v", rec.keys(), rec.clients, rec.synced, rec.failed)
	}
	// After the sync, changes flow as usual and are remembered for the next
	// sweep.
	_ = g2.Set("ns/e", host("e.example.com"))
	g3 := sw.next()
	g3.Synced() // an empty generation (the CRD went away) removes all
	if rec.keys() != "" {
		t.Fatalf("after an empty generation: keys %q", rec.keys())
	}
	g3.Failed(nil)
	if !slices.Equal(rec.failed, []string{"ok"}) {
		t.Errorf("failed = %v", rec.failed)
	}
}

// A Kubernetes Secret mounted as a volume: keys are symlinks into ..data,
// swapped atomically on update. Hidden entries and dangling links (a key
// being removed) are not clusters.
func TestScanDir(t *testing.T) {
	dir := t.TempDir()
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	link := func(target, name string) {
		t.Helper()
		if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(dir, "..2025_01_01_00_00_00.1", "east"), "east-v1")
	write(filepath.Join(dir, "..2025_01_01_00_00_00.1", "west"), "west-v1")
	link("..2025_01_01_00_00_00.1", "..data")
	link("..data/east", "east")
	link("..data/west", "west")
	link("..data/gone", "gone")
	write(filepath.Join(dir, "plain"), "plain-v1")
	if err := os.Mkdir(filepath.Join(dir, "subdir"), 0o755); err != nil {
		t.Fatal(err)
	}
	got, err := scanDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]byte{"east": []byte("east-v1"), "west": []byte("west-v1"), "plain": []byte("plain-v1")}
	if !maps.EqualFunc(got, want, func(a, b []byte) bool { return string(a) == string(b) }) {
		t.Fatalf("scan = %q, want %q", got, want)
	}
	// The kubelet's update: a new timestamped directory, ..data swapped by
	// a rename, the removed key's link left dangling until it is removed.
	write(filepath.Join(dir, "..2025_01_01_00_01_00.2", "east"), "east-v2")
	link("..2025_01_01_00_01_00.2", "..data_tmp")
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	got, err = scanDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	want = map[string][]byte{"east": []byte("east-v2"), "plain": []byte("plain-v1")}
	if !maps.EqualFunc(got, want, func(a, b []byte) bool { return string(a) == string(b) }) {
		t.Fatalf("scan after the swap = %q, want %q", got, want)
	}
	if _, err := scanDir(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing directory is not an error")
	}
}

// A generation's audit counts only what it delivered: the keys of earlier
// generations it has not seen are removed first, as at its sync.
func TestSweeperAuditCountsTheCurrentGeneration(t *testing.T) {
	rec := newRecordSink()
	sw := newSweeper(rec)
	g1 := sw.next()
	_ = g1.Set("ns/a", host("a.example.com"))
	_ = g1.Set("ns/b", host("b.example.com"))
	g1.Synced()
	g2 := sw.next()
	_ = g2.Set("ns/b", host("b.example.com"))
	if err := g2.Audit(1); err != nil {
		t.Errorf("generation 2 delivered one object: %v", err)
	}
	if rec.keys() != "ns/b" {
		t.Errorf("after generation 2's audit: keys %q, want ns/b", rec.keys())
	}
	if err := g2.Audit(2); err == nil {
		t.Error("Audit(2) of one object: no mismatch")
	}
	// A stopped generation audits nothing.
	if err := g1.Audit(7); err != nil {
		t.Errorf("an old generation's audit: %v", err)
	}
}
