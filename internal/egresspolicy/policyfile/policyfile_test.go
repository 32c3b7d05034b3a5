package policyfile

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/metrictest"
	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

var quiet = slog.New(slog.DiscardHandler)

const good = `policies:
- name: app
  unit: app.service
  failMode: fail-closed
  egress:
  - names: [api.example.com, "*.s3.example.net"]
    ports: [{port: 443}]
- name: batch
  cgroup: /sys/fs/cgroup/batch.slice
  mode: audit
  egress:
  - names: [repo.example.org]
`

func TestParse(t *testing.T) {
	set, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	p, ok := set.Select(egresspolicy.Workload{Unit: "app.service"})
	if !ok || p.Mode != egresspolicy.Enforce || p.FailMode != egresspolicy.FailClosed || p.Source != SourceName {
		t.Fatalf("app: %+v %v", p, ok)
	}
	if ports, ok := p.Allows("x.s3.example.net."); !ok || !slices.Equal(ports, []egresspolicy.Port{{Port: 443, Protocol: egresspolicy.TCP}}) {
		t.Fatalf("app allows %v %v", ports, ok)
	}
	if p, ok := set.Select(egresspolicy.Workload{Unit: "/sys/fs/cgroup/batch.slice"}); !ok || p.Mode != egresspolicy.Audit {
		t.Fatalf("batch: %+v %v", p, ok)
	}
	if _, ok := set.Select(egresspolicy.Workload{Namespace: "default"}); ok {
		t.Fatal("a file policy selected a pod")
	}
	if set, err := Parse([]byte("  \n")); err != nil || set.Len() != 0 {
		t.Fatalf("empty file: %v %v", set.Len(), err)
	}
}

func TestParseNamesEveryProblem(t *testing.T) {
	for _, tc := range []struct {
		name, file string
		want       []string
	}{
		{"fields", `policies:
- name: a
  unit: a.service
  mode: deny
  egress:
  - names: ["*", ok.example.com]
    ports: [{port: 70000, protocol: TCP}]
- name: a
  cgroup: relative/path
  egress: [{names: [a.*.b]}]
- unit: x.service
  cgroup: /x
  egress: [{names: [x.com]}]
- name: none
  egress: [{names: [x.com]}]
`, []string{"policies[0].mode", "policies[0].egress[0].names[0]", "policies[0].egress[0].ports[0].port",
			"policies[1].name", "policies[1].cgroup", "policies[1].egress[0].names[0]",
			"policies[2].name", "policies[2].cgroup", "policies[3].unit"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.file))
			var ps egresspolicy.Problems
			if !errors.As(err, &ps) {
				t.Fatalf("err = %v", err)
			}
			var got []string
			for _, p := range ps {
				got = append(got, p.Field)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("fields %q\nwant %q\n(%v)", got, tc.want, err)
			}
		})
	}
	for _, bad := range []string{"policies: [", "policies:\n- name: a\n  unknownField: 1\n"} {
		if _, err := Parse([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// recorder keeps every Set a source published.
type recorder struct {
	mu   sync.Mutex
	sets []*egresspolicy.Set
}

func (r *recorder) publish(s *egresspolicy.Set) {
	r.mu.Lock()
	r.sets = append(r.sets, s)
	r.mu.Unlock()
}
func (r *recorder) count() int { r.mu.Lock(); defer r.mu.Unlock(); return len(r.sets) }
func (r *recorder) last() *egresspolicy.Set {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sets[len(r.sets)-1]
}

type env struct {
	src *Source
	reg *prometheus.Registry
	rec *recorder
}

func start(t *testing.T, path string) (*env, error) {
	t.Helper()
	e := &env{reg: prometheus.NewRegistry(), rec: &recorder{}}
	var err error
	e.src, err = New(path, Options{OnChange: e.rec.publish, Registerer: e.reg, Logger: quiet, PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.src.Close() })
	return e, e.src.Start(context.Background())
}

func (e *env) metric(t *testing.T, name string) float64 { return metrictest.Value(t, e.reg, name) }

func write(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func allows(s *egresspolicy.Set, unit, name string) bool {
	p, ok := s.Select(egresspolicy.Workload{Unit: unit})
	if !ok {
		return false
	}
	_, ok = p.Allows(name)
	return ok
}

func TestSourceReloadsAndKeepsTheLastGoodFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "egress.yaml")
	write(t, path, good)
	e, err := start(t, path)
	if err != nil {
		t.Fatal(err)
	}
	if e.rec.count() != 1 || !allows(e.src.Set(), "app.service", "api.example.com") || e.metric(t, "meshdns_egress_policy_file_policies") != 2 {
		t.Fatalf("first load: %d sets", e.rec.count())
	}

	// A change is published.
	write(t, path, strings.Replace(good, "api.example.com", "api2.example.com", 1))
	testenv.Eventually(t, 5*time.Second, func() bool {
		return e.rec.count() == 2 && allows(e.rec.last(), "app.service", "api2.example.com")
	}, "the changed file was not published")
	if allows(e.src.Set(), "app.service", "api.example.com") {
		t.Fatal("the old name is still allowed")
	}

	// A bad file: nothing published, the last good set stays, the error
	// names every problem, the metrics say so.
	write(t, path, strings.Replace(strings.Replace(good, "api.example.com", "a.*.b", 1), "mode: audit", "mode: loud", 1))
	testenv.Eventually(t, 5*time.Second, func() bool { return e.src.Err() != nil }, "the bad file was not noticed")
	msg := e.src.Err().Error()
	for _, want := range []string{"policies[0].egress[0].names[0]", "policies[1].mode", path} {
		if !strings.Contains(msg, want) {
			t.Errorf("error %q does not name %q", msg, want)
		}
	}
	if e.rec.count() != 2 || !allows(e.src.Set(), "app.service", "api2.example.com") {
		t.Fatal("a bad file changed the policies in force")
	}
	if e.metric(t, "meshdns_egress_policy_file_errors_total") != 1 || e.metric(t, "meshdns_egress_policy_file_valid") != 0 {
		t.Fatal("the bad file was not counted")
	}

	// Fixed: applied.
	write(t, path, good)
	testenv.Eventually(t, 5*time.Second, func() bool {
		return e.rec.count() == 3 && e.src.Err() == nil && allows(e.rec.last(), "app.service", "api.example.com")
	}, "the fixed file was not published")
	if e.metric(t, "meshdns_egress_policy_file_valid") != 1 || e.metric(t, "meshdns_egress_policy_file_loads_total") != 3 {
		t.Fatal("metrics after the fix")
	}

	// Deleted: kept, counted.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, func() bool { return e.src.Err() != nil }, "the deleted file was not noticed")
	if !allows(e.src.Set(), "app.service", "api.example.com") || e.rec.count() != 3 {
		t.Fatal("a deleted file dropped the policies")
	}
}

func TestSourceFollowsTheConfigMapSwap(t *testing.T) {
	dir := t.TempDir()
	testenv.KubeletWrite(t, dir, "egress.yaml", good, 1)
	e, err := start(t, filepath.Join(dir, "egress.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	testenv.KubeletWrite(t, dir, "egress.yaml", strings.Replace(good, "app.service", "web.service", 1), 2)
	testenv.Eventually(t, 5*time.Second, func() bool { return allows(e.src.Set(), "web.service", "api.example.com") },
		"the ..data swap was not followed")
}

func TestSourceStartFailsOnABadFile(t *testing.T) {
	dir := t.TempDir()
	for name, setup := range map[string]func(string){
		"missing": func(string) {},
		"invalid": func(p string) { write(t, p, "policies:\n- name: a\n  unit: a.service\n  egress: [{names: ['*']}]\n") },
		"too large": func(p string) {
			write(t, p, "# "+strings.Repeat("x", DefaultMaxSize)+"\n")
		},
		"a directory": func(p string) { _ = os.Mkdir(p, 0o755) },
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
			setup(path)
			e, err := start(t, path)
			if err == nil {
				t.Fatal("started")
			}
			if e.rec.count() != 0 || e.src.Set() != nil {
				t.Fatal("published a set")
			}
			t.Log(err)
		})
	}
}
