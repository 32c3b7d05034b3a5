// Package policyfile is the egress policy source of a VM: a YAML (or JSON)
// file whose policies select a systemd unit or a cgroup path, read at start
// and reloaded when it changes, as the names file is (fsnotify on its
// directory, a stat poll as fallback, the Kubernetes ConfigMap "..data"
// swap included). Every load is all or nothing: a file with any problem,
// unreadable, deleted or too large keeps the policies last loaded in force,
// logs and counts the error and says every problem with its field path; it
// is never half-applied.
//
//	policies:
//	- name: app
//	  unit: app.service            # or cgroup: /sys/fs/cgroup/app.slice
//	  mode: enforce                # default enforce; or audit
//	  failMode: fail-closed        # default fail-open
//	  clusterInternal: false
//	  egress:
//	  - names: [api.example.com, "*.s3.example.net"]
//	    ports: [{port: 443, protocol: TCP}]   # none: any port
package policyfile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/yaml"

	"github.com/meshdns/meshdns-ebpf/internal/egresspolicy"
	"github.com/meshdns/meshdns-ebpf/internal/filewatch"
)

// SourceName is the Source field of the policies of a policy file.
const SourceName = "file"

// DefaultMaxSize caps the policy file's size.
const DefaultMaxSize = 4 << 20

// DefaultPollInterval is how often the file is stat'ed besides fsnotify.
const DefaultPollInterval = time.Second

// Options configure a policy file Source.
type Options struct {
	// OnChange is called with every new Set: the file's first load (in
	// Start) and each later change that loaded. Calls do not overlap.
	OnChange func(*egresspolicy.Set)
	// Registerer gets the source's metrics (none when nil).
	Registerer   prometheus.Registerer
	Logger       *slog.Logger
	MaxSize      int64         // default DefaultMaxSize
	PollInterval time.Duration // default DefaultPollInterval
}

// File is the YAML document.
type File struct {
	Policies []FilePolicy `json:"policies"`
}

// FilePolicy is one policy of the file: a unit or a cgroup path, and the
// policy fields of egresspolicy.Policy.
type FilePolicy struct {
	Name            string                `json:"name"`
	Unit            string                `json:"unit,omitempty"`
	Cgroup          string                `json:"cgroup,omitempty"`
	Mode            egresspolicy.Mode     `json:"mode,omitempty"`
	FailMode        egresspolicy.FailMode `json:"failMode,omitempty"`
	ClusterInternal bool                  `json:"clusterInternal,omitempty"`
	Egress          []egresspolicy.Rule   `json:"egress"`
}

// Parse decodes and validates a policy file and returns its Set, or an
// error naming every problem ("policies[1].egress[0].names[2]: ...").
func Parse(data []byte) (*egresspolicy.Set, error) {
	var f File
	if len(bytes.TrimSpace(data)) > 0 {
		if err := yaml.UnmarshalStrict(data, &f); err != nil {
			return nil, fmt.Errorf("%s", strings.TrimPrefix(err.Error(), "error converting YAML to JSON: "))
		}
	}
	var all egresspolicy.Problems
	var ps []egresspolicy.Policy
	seen := map[string]int{}
	for i, fp := range f.Policies {
		at := fmt.Sprintf("policies[%d].", i)
		var own egresspolicy.Problems
		switch {
		case fp.Name == "":
			own = append(own, egresspolicy.Problem{Field: "name", Detail: "empty: every policy has a name"})
		case seen[fp.Name] > 0:
			own = append(own, egresspolicy.Problem{Field: "name", Detail: fmt.Sprintf("%q is also the name of policies[%d]", fp.Name, seen[fp.Name]-1)})
		default:
			seen[fp.Name] = i + 1
		}
		unit := fp.Unit
		switch {
		case fp.Unit != "" && fp.Cgroup != "":
			own = append(own, egresspolicy.Problem{Field: "cgroup", Detail: "both unit and cgroup: a policy selects one"})
		case fp.Unit == "" && fp.Cgroup == "":
			own = append(own, egresspolicy.Problem{Field: "unit", Detail: "no unit and no cgroup: a policy selects a systemd unit or a cgroup path"})
		case fp.Unit != "" && strings.Contains(fp.Unit, "/"):
			own = append(own, egresspolicy.Problem{Field: "unit", Detail: fmt.Sprintf("%q is a path: use cgroup", fp.Unit)})
		case fp.Cgroup != "":
			if !filepath.IsAbs(fp.Cgroup) || filepath.Clean(fp.Cgroup) != fp.Cgroup {
				own = append(own, egresspolicy.Problem{Field: "cgroup", Detail: fmt.Sprintf("%q is not a clean absolute path", fp.Cgroup)})
			}
			unit = fp.Cgroup
		}
		p := egresspolicy.Policy{Source: SourceName, Name: fp.Name, Unit: unit, Mode: fp.Mode, FailMode: fp.FailMode,
			ClusterInternal: fp.ClusterInternal, Egress: fp.Egress}
		p.Default()
		var vp egresspolicy.Problems
		if err := p.Validate(); err != nil && !errors.As(err, &vp) {
			return nil, err
		}
		// Validate's unit check, said once: under the field the file
		// used, and not again after the checks above.
		selProblem := slices.ContainsFunc(own, func(p egresspolicy.Problem) bool { return p.Field == "unit" || p.Field == "cgroup" })
		for _, p := range vp {
			if p.Field == "unit" {
				if selProblem {
					continue
				}
				if fp.Cgroup != "" {
					p.Field = "cgroup"
				}
			}
			own = append(own, p)
		}
		all = append(all, own.Prefixed(at)...)
		ps = append(ps, p)
	}
	if len(all) > 0 {
		return nil, all
	}
	return egresspolicy.NewSet(ps)
}

// Source reads one policy file and publishes its Set.
type Source struct {
	path string
	opts Options
	log  *slog.Logger

	errs     prometheus.Counter
	loads    prometheus.Counter
	policies prometheus.Gauge
	valid    prometheus.Gauge

	loadMu sync.Mutex // one load at a time; guards last and tried
	last   filewatch.Fingerprint
	tried  bool

	mu      sync.Mutex // guards set and lastErr
	set     *egresspolicy.Set
	lastErr error

	cancel context.CancelFunc
	done   chan struct{}
}

// New creates the source for path. It reads nothing yet.
func New(path string, opts Options) (*Source, error) {
	if path == "" {
		return nil, errors.New("egress policy file: empty path")
	}
	if opts.MaxSize <= 0 {
		opts.MaxSize = DefaultMaxSize
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = DefaultPollInterval
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &Source{path: path, opts: opts, log: opts.Logger.With("source", "egress-policy-file", "path", path),
		errs: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshdns_egress_policy_file_errors_total",
			Help: "Loads of the egress policy file that failed (bad content, unreadable, deleted); the last good policies stay in force."}),
		loads: prometheus.NewCounter(prometheus.CounterOpts{Name: "meshdns_egress_policy_file_loads_total",
			Help: "Loads of the egress policy file that were applied."}),
		policies: prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshdns_egress_policy_file_policies",
			Help: "Policies of the egress policy file in force."}),
		valid: prometheus.NewGauge(prometheus.GaugeOpts{Name: "meshdns_egress_policy_file_valid",
			Help: "1 when the egress policy file as it is now is in force, 0 when its last load failed."}),
	}
	if opts.Registerer != nil {
		for _, c := range []prometheus.Collector{s.errs, s.loads, s.policies, s.valid} {
			if err := opts.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("register egress policy file metrics: %w", err)
			}
		}
	}
	return s, nil
}

// Path is the watched file.
func (s *Source) Path() string { return s.path }

// Set is the policy set in force (nil before Start).
func (s *Source) Set() *egresspolicy.Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.set
}

// Err is the error of the last load (nil when the file as it is now is in
// force).
func (s *Source) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// Start loads the file, publishes its Set, and watches it until Close or
// ctx ends. A file that does not load at start is an error: there is no
// previous policy to keep.
func (s *Source) Start(ctx context.Context) error {
	if s.done != nil {
		return errors.New("egress policy file: started twice")
	}
	if err := s.load(true); err != nil {
		return err
	}
	ctx, s.cancel = context.WithCancel(ctx)
	s.done = make(chan struct{})
	go func() {
		defer close(s.done)
		s.watch(ctx)
	}()
	return nil
}

// Close stops watching and waits for the watcher to end.
func (s *Source) Close() error {
	if s.cancel != nil {
		s.cancel()
		<-s.done
	}
	return nil
}

// load reads the file when it changed since the last attempt (or when
// force), and publishes its Set when it loads. A failed load keeps the
// Set in force.
func (s *Source) load(force bool) error {
	s.loadMu.Lock()
	defer s.loadMu.Unlock()
	fp := filewatch.Stat(s.path)
	if s.tried && fp == s.last && !force {
		return nil
	}
	s.last, s.tried = fp, true
	set, err := s.read()
	if err != nil {
		err = fmt.Errorf("egress policy file %s: %w", s.path, err)
		s.mu.Lock()
		s.lastErr = err
		kept := s.set.Len()
		s.mu.Unlock()
		s.errs.Inc()
		s.valid.Set(0)
		s.log.Error("egress policy file not loaded, keeping the policies in force", "err", err, "policies", kept)
		return err
	}
	s.mu.Lock()
	s.set, s.lastErr = set, nil
	s.mu.Unlock()
	s.loads.Inc()
	s.valid.Set(1)
	s.policies.Set(float64(set.Len()))
	s.log.Info("egress policy file loaded", "policies", set.Len())
	if s.opts.OnChange != nil {
		s.opts.OnChange(set)
	}
	return nil
}

// read reads and parses the file: a regular file of at most MaxSize bytes
// (a FIFO or device is an error, never a blocking read).
func (s *Source) read() (*egresspolicy.Set, error) {
	fi, err := os.Stat(s.path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	fh, err := os.OpenFile(s.path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	if fi, err = fh.Stat(); err != nil || !fi.Mode().IsRegular() {
		return nil, errors.New("not a regular file")
	}
	data, err := io.ReadAll(io.LimitReader(fh, s.opts.MaxSize+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > s.opts.MaxSize {
		return nil, fmt.Errorf("more than the limit of %d bytes", s.opts.MaxSize)
	}
	return Parse(data)
}

// watch reloads the file on changes (internal/filewatch) until ctx ends.
func (s *Source) watch(ctx context.Context) {
	filewatch.Watch(ctx, s.path, s.opts.PollInterval, s.log, func() { _ = s.load(false) })
}
