package nametable

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"
)

// meshFile renders n Kubernetes services the way bench/internal/meshdata
// does (100 per namespace, one IPv4 address, registry, shortname and
// namespace given), as compact JSON. Entry i has generation gen's address
// when changed(i), generation 1's otherwise.
func meshFile(n, gen int, changed func(i int) bool) []byte {
	var b bytes.Buffer
	b.Grow(n * 110)
	b.WriteString(`{"table":{`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		g := 1
		if changed(i) {
			g = gen
		}
		v := i + 1
		fmt.Fprintf(&b, `"svc-%d.ns-%d.svc.cluster.local":{"ips":["%d.%d.%d.%d"],"registry":"Kubernetes","shortname":"svc-%d","namespace":"ns-%d"}`,
			i%100, i/100, 240+g, byte(v>>16), byte(v>>8), byte(v), i%100, i/100)
	}
	b.WriteString(`}}`)
	return b.Bytes()
}

func every(i int) bool        { return true }
func onePercent(i int) bool   { return i%100 == 0 }
func nothingNew(i int) bool   { return false }
func reloadSizes() (int, int) { return 100000, 100000 / 100 }

// loadFile reads data as the next version and applies it to b, the way the
// file source and the store do, and publishes.
func loadFile(tb testing.TB, r *Reader, b *Builder, data []byte) *Table {
	tb.Helper()
	c, err := r.Read(data)
	if err != nil {
		tb.Fatal(err)
	}
	if err := b.Apply(FileSource, &c.Change); err != nil {
		tb.Fatal(err)
	}
	r.Applied(c)
	t, err := b.Publish()
	if err != nil {
		tb.Fatal(err)
	}
	return t
}

// appliedReader is a Reader that read data as its first version, applied.
func appliedReader(tb testing.TB, data []byte) *Reader {
	tb.Helper()
	r := NewReader("")
	v, err := r.Read(data)
	if err != nil {
		tb.Fatal(err)
	}
	r.Applied(v)
	return r
}

// allocated is the heap bytes fn allocates.
func allocated(fn func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// Reading and applying a 100k-entry file allocates little beyond the table
// it builds, and a reload that changes 1% of the entries allocates in
// proportion to what changed: the file's entries are never all decoded
// and held at once, and unchanged entries cost no allocation. The bounds
// are bytes per entry of the whole file (first load) and per changed
// entry (reload); the measured values are in bench/RESULTS.md.
func TestReloadAllocations100k(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	const (
		maxFirstPerEntry   = 1000 // the table's own hosts, names and maps included
		maxReloadPerChange = 6000 // the copied shards included
	)
	n, changes := reloadSizes()
	v1 := meshFile(n, 1, nothingNew)
	v2 := meshFile(n, 2, onePercent)
	b, err := NewBuilder(Options{})
	if err != nil {
		t.Fatal(err)
	}
	b.AddSource(FileSource, 0)
	r := NewReader("")
	var tab *Table
	first := allocated(func() { tab = loadFile(t, r, b, v1) })
	if tab.Len() != n {
		t.Fatalf("first load: %d hosts, want %d", tab.Len(), n)
	}
	reload := allocated(func() { tab = loadFile(t, r, b, v2) })
	if tab.Len() != n {
		t.Fatalf("reload: %d hosts, want %d", tab.Len(), n)
	}
	perEntry := float64(first) / float64(n)
	perChange := float64(reload) / float64(changes)
	t.Logf("first load %.1f MB (%.0f B per entry), 1%% reload %.2f MB (%.0f B per changed entry)",
		float64(first)/1e6, perEntry, float64(reload)/1e6, perChange)
	if perEntry > maxFirstPerEntry {
		t.Errorf("first load allocated %.0f B per entry, want <= %d", perEntry, maxFirstPerEntry)
	}
	if perChange > maxReloadPerChange {
		t.Errorf("1%% reload allocated %.0f B per changed entry, want <= %d", perChange, maxReloadPerChange)
	}
}

// BenchmarkReload100k reads and applies versions of a 100k-entry file:
// the first load, a reload that changes 1% of the entries, one that
// changes every address (the scale benchmark's rewrite), and one that
// changes nothing.
func BenchmarkReload100k(b *testing.B) {
	n, _ := reloadSizes()
	v1 := meshFile(n, 1, nothingNew)
	for _, bc := range []struct {
		name    string
		changed func(int) bool
	}{{"first", nil}, {"partial", onePercent}, {"full", every}, {"same", nothingNew}} {
		b.Run(bc.name, func(b *testing.B) {
			versions := [][]byte{v1}
			if bc.changed != nil {
				versions = append(versions, meshFile(n, 2, bc.changed))
			}
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				bl, err := NewBuilder(Options{})
				if err != nil {
					b.Fatal(err)
				}
				bl.AddSource(FileSource, 0)
				r := NewReader("")
				if bc.changed != nil {
					loadFile(b, r, bl, v1)
				}
				b.StartTimer()
				loadFile(b, r, bl, versions[len(versions)-1])
			}
		})
	}
}

// BenchmarkReadUnchanged100k reads a 100k-entry file whose entries all
// are as applied: the cost of a reload that changes nothing.
func BenchmarkReadUnchanged100k(b *testing.B) {
	n, _ := reloadSizes()
	v1 := meshFile(n, 1, nothingNew)
	r := appliedReader(b, v1)
	b.ReportAllocs()
	for b.Loop() {
		if v, err := r.Read(v1); err != nil || !v.Empty() {
			b.Fatal(err, v.Empty())
		}
	}
}
