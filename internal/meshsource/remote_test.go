package meshsource

import (
	"errors"
	"log/slog"
	"maps"
	"slices"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/names"
)

// recordSources is a SourceSet that records what Clusters adds and removes.
type recordSources struct {
	added   map[string]names.SourceOptions
	removed []string
	refuse  string // Add of this source fails
}

func (r *recordSources) Add(src names.Source, opts names.SourceOptions) error {
	if src.Name() == r.refuse {
		return errors.New("refused")
	}
	r.added[src.Name()] = opts
	return nil
}

func (r *recordSources) Remove(name string) {
	delete(r.added, name)
	r.removed = append(r.removed, name)
}

func TestClustersFeedOneSourcePerCluster(t *testing.T) {
	set := &recordSources{added: map[string]names.SourceOptions{}}
	if _, err := NewClusters(ClustersConfig{Dir: t.TempDir()}); err == nil {
		t.Fatal("NewClusters without a source set succeeded")
	}
	m, err := NewClusters(ClustersConfig{Sources: set, Dir: t.TempDir(), Domain: "cluster.local", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	r := &reconciler{m: m, running: map[string]*clusterSource{}, applied: map[string][]byte{}}
	want := names.SourceOptions{Priority: names.PriorityRemoteCluster, NonBlocking: true}

	r.apply(map[string][]byte{"east": []byte("a"), "west": []byte("b")}, nil)
	if got := slices.Sorted(maps.Keys(set.added)); !slices.Equal(got, []string{ClusterPrefix + "east", ClusterPrefix + "west"}) {
		t.Fatalf("sources after two kubeconfigs: %v", got)
	}
	for name, opts := range set.added {
		if opts != want {
			t.Errorf("%s added with %+v, want %+v", name, opts, want)
		}
	}

	// A changed kubeconfig goes to the running source: nothing is added
	// or removed.
	r.apply(map[string][]byte{"east": []byte("a2"), "west": []byte("b")}, nil)
	if len(set.added) != 2 || len(set.removed) != 0 {
		t.Errorf("after a changed kubeconfig: added %v, removed %v", set.added, set.removed)
	}
	if got := string(r.applied["east"]); got != "a2" {
		t.Errorf("east's kubeconfig %q, want a2", got)
	}

	// A cluster that goes is removed, with its source.
	r.apply(map[string][]byte{"west": []byte("b")}, nil)
	if !slices.Equal(set.removed, []string{ClusterPrefix + "east"}) {
		t.Errorf("removed %v, want only %s", set.removed, ClusterPrefix+"east")
	}

	// A source the set refuses is not running: the next apply tries again.
	set.refuse = ClusterPrefix + "north"
	r.apply(map[string][]byte{"west": []byte("b"), "north": []byte("c")}, nil)
	if _, ok := r.running["north"]; ok {
		t.Error("a refused cluster source counts as running")
	}
	set.refuse = ""
	r.apply(map[string][]byte{"west": []byte("b"), "north": []byte("c")}, nil)
	if _, ok := set.added[ClusterPrefix+"north"]; !ok {
		t.Error("a refused cluster source was not added again on the next apply")
	}
}
