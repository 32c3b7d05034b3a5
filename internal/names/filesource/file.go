// Package filesource has the name sources that come from name table files
// (docs/name-table.md): File reads a JSON or YAML file and reloads it live
// (including the Kubernetes ConfigMap "..data" symlink swap); Static serves
// a table held in memory, such as the embedded demo table.
package filesource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/filewatch"
	"github.com/meshdns/meshdns-ebpf/internal/names"
	"github.com/meshdns/meshdns-ebpf/internal/nametable"
)

// PollInterval is how often the watcher stats the file as a fallback to
// fsnotify (which misses changes on some filesystems and bind mounts).
const PollInterval = time.Second

// DefaultMaxSize caps the size of a names file (100k Services take about
// 15 MB of YAML).
const DefaultMaxSize = 64 << 20

// Options configure a File source.
type Options struct {
	// Domain is the cluster domain (for Kubernetes short names).
	Domain string
	// MaxSize caps the file size (default DefaultMaxSize).
	MaxSize int64
	Logger  *slog.Logger
	// LargeChange, when set, is told when a reload turns out, while the
	// file is read, to rewrite most of it (true), and once that reload was
	// delivered or failed (false): the decoding of the changed entries comes
	// before the store's part of the change (names.Config.LargeChange, which
	// the agent wires to the same hook).
	LargeChange func(begins bool)
}

// File is the source of a names file. A file that fails to load (bad
// content, deleted, unreadable, not a regular file, too large) keeps the
// last good state serving, and the failure is logged and counted. Reading
// never blocks on a FIFO or device, and no lock is held while reading.
type File struct {
	path string
	opts Options
	log  *slog.Logger

	mu     sync.Mutex // guards the fields below
	last   filewatch.Fingerprint
	tried  bool
	reader *nametable.Reader  // what was applied, to read only what changes
	ready  *nametable.Version // checked before Run, delivered first by Run
	took   time.Duration
}

type content struct {
	hosts   map[string]nametable.Host
	clients map[netip.Addr]string
}

// NewFile creates the source for path. It reads nothing yet.
func NewFile(path string, opts Options) (*File, error) {
	if path == "" {
		return nil, errors.New("name table path is empty")
	}
	if opts.MaxSize <= 0 {
		opts.MaxSize = DefaultMaxSize
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &File{path: path, opts: opts, log: opts.Logger.With("source", "file", "path", path),
		reader: nametable.NewReader(opts.Domain)}, nil
}

// Name implements names.Source.
func (f *File) Name() string { return "file" }

// Path is the watched file.
func (f *File) Path() string { return f.path }

// Check reads and validates the file now. The agent calls it before it
// starts, so that a bad file at start is an error, not something to serve
// around.
func (f *File) Check() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	start := time.Now()
	fp := filewatch.Stat(f.path)
	c, err := f.read()
	f.last, f.tried = fp, true
	if err != nil {
		return err
	}
	f.ready, f.took = c, time.Since(start)
	return nil
}

// read reads, parses and validates the file, and returns what it changes
// against the last version applied. f.mu is held: one read at a time.
func (f *File) read() (*nametable.Version, error) {
	fh, err := openRegular(f.path, f.opts.MaxSize)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	in := &limitReader{r: fh, left: f.opts.MaxSize}
	v, err := f.reader.Decode(in)
	if in.over {
		return nil, fmt.Errorf("name table %s: more than the limit of %d bytes", f.path, f.opts.MaxSize)
	}
	if err != nil {
		return nil, fmt.Errorf("name table %s: %w", f.path, err)
	}
	return v, nil
}

// apply delivers what v changes and, once the store took it, remembers v
// as the applied version. f.mu is held.
func (f *File) apply(sink names.Sink, v *nametable.Version) error {
	if v.Empty() {
		return nil
	}
	if err := sink.Apply(&v.Change); err != nil {
		return fmt.Errorf("name table %s: %w", f.path, err)
	}
	f.reader.Applied(v)
	return nil
}

// openRegular opens a regular file of at most max bytes. A FIFO, socket or
// device is an error, never a blocking read.
func openRegular(path string, max int64) (*os.File, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("name table %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("name table %s: not a regular file (%s)", path, fi.Mode().Type())
	}
	// O_NONBLOCK: should a FIFO appear between Stat and Open, open and read
	// return at once instead of waiting for a writer.
	fh, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("name table %s: %w", path, err)
	}
	if fi, err = fh.Stat(); err != nil || !fi.Mode().IsRegular() {
		fh.Close()
		return nil, fmt.Errorf("name table %s: not a regular file", path)
	}
	if fi.Size() > max {
		fh.Close()
		return nil, fmt.Errorf("name table %s: %d bytes, more than the limit of %d", path, fi.Size(), max)
	}
	return fh, nil
}

// limitReader reads at most left bytes of r, then reports the end of the
// input and, when r had more, over: a file that grows past the limit
// while it is read is refused.
type limitReader struct {
	r    io.Reader
	left int64
	over bool
}

func (l *limitReader) Read(p []byte) (int, error) {
	if l.left <= 0 {
		var one [1]byte
		if n, _ := l.r.Read(one[:]); n > 0 {
			l.over = true
		}
		return 0, io.EOF
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.r.Read(p)
	l.left -= int64(n)
	return n, err
}

// load reads the file when its fingerprint changed since the last attempt
// (a broken file is not re-read until it changes) and delivers what
// changed, at a low CPU priority (background).
func (f *File) load(sink names.Sink, force bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fp := filewatch.Stat(f.path)
	if f.tried && fp == f.last && !force {
		return
	}
	f.last, f.tried = fp, true

	start := time.Now()
	var c *nametable.Version
	var err error
	background(func() {
		rewrite := false
		if f.opts.LargeChange != nil {
			f.reader.Rewrite = func() { rewrite = true; f.opts.LargeChange(true) }
			defer func() { f.reader.Rewrite = nil }()
		}
		if c, err = f.read(); err == nil {
			err = f.apply(sink, c)
		}
		if rewrite {
			f.opts.LargeChange(false)
		}
	})
	if err != nil {
		f.log.Error("name table load failed, keeping the last good one", "err", err)
		sink.Failed(err)
		return
	}
	sink.Failed(nil)
	f.log.Info("name table loaded", "hosts", c.Entries, "changed", len(c.Set), "gone", len(c.Gone), "clients_changed", c.ClientsChanged,
		"duration", time.Since(start))
}

// Run implements names.Source: it delivers the file (the one Check read,
// or reads it now) and then watches it until ctx ends: fsnotify on the
// file's directory, plus a stat/readlink poll every PollInterval as a
// fallback.
func (f *File) Run(ctx context.Context, sink names.Sink) error {
	f.mu.Lock()
	c, took := f.ready, f.took
	f.ready = nil
	if c != nil {
		start := time.Now()
		err := f.apply(sink, c)
		f.mu.Unlock()
		if err != nil {
			return err
		}
		f.log.Info("name table loaded", "hosts", c.Entries, "duration", took+time.Since(start))
	} else {
		f.mu.Unlock()
		f.load(sink, true)
	}
	sink.Synced()

	filewatch.Watch(ctx, f.path, PollInterval, f.log, func() { f.load(sink, false) })
	return nil
}

// Static serves a name table held in memory (the embedded demo table).
type Static struct {
	name string
	c    content
}

// NewStatic parses data (JSON or YAML) into a source called name.
func NewStatic(name string, data []byte, domain string) (*Static, error) {
	file, err := nametable.Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s name table: %w", name, err)
	}
	hosts, clients, err := file.Hosts(domain)
	if err != nil {
		return nil, fmt.Errorf("%s name table: %w", name, err)
	}
	return &Static{name: name, c: content{hosts, clients}}, nil
}

// Name implements names.Source.
func (s *Static) Name() string { return s.name }

// Run implements names.Source.
func (s *Static) Run(ctx context.Context, sink names.Sink) error {
	if err := sink.Load(s.c.hosts, s.c.clients); err != nil {
		return err
	}
	sink.Synced()
	<-ctx.Done()
	return nil
}
