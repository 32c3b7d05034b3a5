//go:build linux

package ctzone

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ti-mo/conntrack"
)

// Rules is a rule set: New validates, Start installs it and starts the repair
// loop, Close removes it. Its methods act on the network namespace Start was
// called in (or Config.Netns), whatever goroutine calls them.
type Rules struct {
	cfg     *normalized
	backend string
	ns      *nsHandle

	op        sync.Mutex // serialises Start, Check and Close: no repair after removal
	mu        sync.Mutex // guards the fields below
	started   bool
	closed    bool
	handoff   bool
	canonical map[string][]string // "ip4 nat MESHDNS-OUTPUT" -> rules as iptables-save prints them
	stopRun   context.CancelFunc
	runDone   chan struct{}
}

// Backend is the iptables backend the rules live in.
func (r *Rules) Backend() string { return r.backend }

// Zone is the conntrack zone of the captured flows.
func (r *Rules) Zone() uint16 { return r.cfg.Zone }

func key(v6 bool, table, chain string) string {
	fam := "ip4"
	if v6 {
		fam = "ip6"
	}
	return fam + " " + table + " " + chain
}

// New validates cfg. It touches nothing.
func New(cfg Config) (*Rules, error) {
	n, err := normalize(cfg)
	if err != nil {
		return nil, fmt.Errorf("iptables mode config: %w", err)
	}
	return &Rules{cfg: n, canonical: map[string][]string{}}, nil
}

// Start programs the capture and zone rules (see the package comment and
// docs/iptables-mode.md), flushes the conntrack entries that would send a query
// past them, and starts checking and repairing them every CheckInterval until
// Close. It is idempotent: installing the same Config again yields the same rule
// set, and it replaces leftovers of a crashed agent (or adopts a predecessor's).
// Chains of ours that the Config no longer needs are removed. On error, it
// removes every chain and rule of ours again.
func (r *Rules) Start(ctx context.Context) error {
	r.op.Lock()
	defer r.op.Unlock()
	r.mu.Lock()
	if r.started || r.closed {
		r.mu.Unlock()
		return errors.New("rules already started or closed")
	}
	r.started = true
	r.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	n := r.cfg
	for _, w := range n.warnings {
		n.Logger.Warn("iptables mode: " + w)
	}
	ns, err := openNetns(n.Netns)
	if err != nil {
		return err
	}
	r.ns = ns
	err = ns.do(func() error {
		r.backend = n.Backend
		if r.backend == "" {
			b, err := DetectBackend()
			if err != nil {
				return err
			}
			r.backend = b
		}
		if err := r.applyAll(); err != nil {
			return err
		}
		flushed, err := r.flushStale()
		if err != nil {
			return err
		}
		n.Logger.Info("iptables mode rules installed", "backend", r.backend, "zone", n.Zone,
			"nameservers", len(n.fams[0].servers)+len(n.fams[1].servers), "capture_all", n.CaptureAll,
			"pod_capture", n.fams[0].podCapture() || n.fams[1].podCapture(), "stale_conntrack_flushed", flushed)
		return nil
	})
	if err != nil {
		if r.backend != "" {
			if rerr := ns.do(func() error { _, e := r.removeAll(); return e }); rerr != nil {
				err = errors.Join(err, fmt.Errorf("remove partial install: %w", rerr))
			}
		}
		ns.close()
		r.ns = nil
		return fmt.Errorf("install iptables rules: %w", err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	r.stopRun, r.runDone = cancel, make(chan struct{})
	go r.run(rctx)
	return nil
}

// families returns the ipt of each family we must look at: the ones with rules,
// and v6 when the kernel has it (leftovers may be there).
func (r *Rules) families() []ipt {
	out := []ipt{{backend: r.backend}}
	if r.cfg.fams[1].captures() || ipv6Enabled() {
		out = append(out, ipt{backend: r.backend, v6: true})
	}
	return out
}

func (r *Rules) desired(v6 bool, table string) *tableSpec {
	for _, t := range r.cfg.tables() {
		if t.v6 == v6 && t.table == table {
			return &t
		}
	}
	return nil
}

// applyAll installs every table, nat before raw.
func (r *Rules) applyAll() error {
	for _, x := range r.families() {
		for _, table := range []string{"nat", "raw"} {
			want := r.desired(x.v6, table)
			if want == nil && x.v6 {
				if _, err := x.binary("-save"); err != nil {
					continue // no ip6tables and nothing to do for v6
				}
			}
			if err := r.applyTable(x, table, want); err != nil {
				return err
			}
			if testHookApplied != nil {
				if err := testHookApplied(x.v6, table); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// testHookApplied, when set (tests), runs after each table Start applied.
var testHookApplied func(v6 bool, table string) error

// applyTable makes one table hold exactly our chains of want (nil: none) with
// one jump each, first in its built-in chain, in one restore transaction.
func (r *Rules) applyTable(x ipt, table string, want *tableSpec) error {
	st, err := x.save(table)
	if err != nil {
		return err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "*%s\n", table)
	wanted := map[string]bool{}
	if want != nil {
		for _, c := range want.chains {
			wanted[c.name] = true
			// Declaring an existing user chain in --noflush mode flushes it.
			fmt.Fprintf(&b, ":%s - [0:0]\n", c.name)
		}
		for _, c := range want.chains {
			for _, rule := range c.rules {
				fmt.Fprintf(&b, "-A %s %s\n", c.name, strings.Join(rule, " "))
			}
		}
	}
	changed := want != nil
	// Jumps: keep a jump that is already the only one and first; otherwise
	// delete every jump to a chain of ours and insert one at the top.
	jumps := st.jumps()
	hooks := slices.Sorted(func(yield func(string) bool) {
		for h := range jumps {
			if !yield(h) {
				return
			}
		}
	})
	keep := map[string]bool{}
	if want != nil {
		for _, c := range want.chains {
			if js := jumps[c.hook]; len(js) == 1 && len(st.rules[c.hook]) > 0 && st.rules[c.hook][0] == js[0] &&
				jumpTarget(js[0]) == c.name && strings.Contains(js[0], commentTag) {
				keep[c.hook] = true
			}
		}
	}
	for _, h := range hooks {
		if keep[h] {
			continue
		}
		for _, j := range jumps[h] {
			fmt.Fprintf(&b, "-D %s %s\n", h, j)
			changed = true
		}
	}
	if want != nil {
		for _, c := range want.chains {
			if !keep[c.hook] {
				fmt.Fprintf(&b, "-I %s 1 %s\n", c.hook, strings.Join(jumpRule(c.name), " "))
			}
		}
	}
	for _, c := range st.ours() {
		if !wanted[c] {
			fmt.Fprintf(&b, "-F %s\n-X %s\n", c, c)
			changed = true
		}
	}
	b.WriteString("COMMIT\n")
	if !changed {
		return nil
	}
	if err := x.restore(b.String()); err != nil {
		return fmt.Errorf("%s %s table: %w", x.familyName(), table, err)
	}
	if want == nil {
		return nil
	}
	// Record the rules as the backend prints them, for Run's comparison.
	st, err = x.save(table)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range want.chains {
		got := st.rules[c.name]
		if len(got) != len(c.rules) {
			return fmt.Errorf("%s %s chain %s: installed %d rules, reads back %d", x.familyName(), table, c.name, len(c.rules), len(got))
		}
		r.canonical[key(x.v6, table, c.name)] = slices.Clone(got)
	}
	return nil
}

// drift says what is wrong with one table, "" when it is as installed.
func (r *Rules) drift(x ipt, table string, want *tableSpec) (string, error) {
	st, err := x.save(table)
	if err != nil {
		return "", err
	}
	var problems []string
	wanted := map[string]bool{}
	jumps := st.jumps()
	if want != nil {
		r.mu.Lock()
		for _, c := range want.chains {
			wanted[c.name] = true
			switch {
			case !st.chains[c.name]:
				problems = append(problems, "chain "+c.name+" missing")
			case !slices.Equal(st.rules[c.name], r.canonical[key(x.v6, table, c.name)]):
				problems = append(problems, fmt.Sprintf("chain %s has %d rules that differ from the %d installed", c.name, len(st.rules[c.name]), len(c.rules)))
			}
			js := jumps[c.hook]
			switch {
			case len(js) == 0:
				problems = append(problems, "jump from "+c.hook+" missing")
			case len(js) > 1:
				problems = append(problems, fmt.Sprintf("%d jumps from %s", len(js), c.hook))
			case st.rules[c.hook][0] != js[0]:
				problems = append(problems, "jump from "+c.hook+" is not the first rule")
			}
		}
		r.mu.Unlock()
	}
	for _, c := range st.ours() {
		if !wanted[c] {
			problems = append(problems, "unexpected chain "+c)
		}
	}
	if len(problems) == 0 {
		return "", nil
	}
	return strings.Join(problems, "; "), nil
}

// Check compares the installed rules with the kernel's and repairs any table
// that drifted (then flushes the conntrack entries made meanwhile that would
// send a query the wrong way). It returns what it repaired.
func (r *Rules) Check() ([]string, error) {
	r.op.Lock()
	defer r.op.Unlock()
	r.mu.Lock()
	closed, started := r.closed, r.ns != nil
	r.mu.Unlock()
	if closed || !started {
		return nil, errors.New("rules are not installed")
	}
	var repaired []string
	err := r.ns.do(func() error {
		var errs []error
		for _, x := range r.families() {
			for _, table := range []string{"nat", "raw"} {
				want := r.desired(x.v6, table)
				if want == nil && x.v6 {
					if _, err := x.binary("-save"); err != nil {
						continue
					}
				}
				problem, err := r.drift(x, table, want)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				if problem == "" {
					continue
				}
				if err := r.applyTable(x, table, want); err != nil {
					errs = append(errs, fmt.Errorf("repair %s %s table (%s): %w", x.familyName(), table, problem, err))
					continue
				}
				repaired = append(repaired, fmt.Sprintf("%s %s: %s", x.familyName(), table, problem))
			}
		}
		if len(repaired) > 0 {
			if _, err := r.flushStale(); err != nil {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	})
	return repaired, err
}

// run checks and repairs the rules every CheckInterval until ctx is done or the
// rules are closed, logging every repair.
func (r *Rules) run(ctx context.Context) {
	defer close(r.runDone)
	t := time.NewTicker(r.cfg.CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.mu.Lock()
		closed := r.closed
		r.mu.Unlock()
		if closed {
			return
		}
		repaired, err := r.Check()
		for _, what := range repaired {
			r.cfg.Logger.Warn("iptables mode rules repaired", "what", what, "backend", r.backend)
		}
		if err != nil {
			r.cfg.Logger.Error("iptables mode rules check failed", "err", err)
		}
	}
}

// StopCapture removes the capture (the nat-table rules: new queries reach
// their original nameserver) and stops the repair loop, but keeps the zone
// rules and the conntrack entries of flows already captured, so the replies to
// queries the resolver still answers are translated back. Close removes the
// rest. For a stop that drains the resolver in between.
func (r *Rules) StopCapture() error {
	r.mu.Lock()
	stop, done := r.stopRun, r.runDone
	r.stopRun = nil
	r.mu.Unlock()
	stopRepair(stop, done)
	r.op.Lock()
	defer r.op.Unlock()
	if r.ns == nil {
		return nil
	}
	err := r.ns.do(func() error {
		var errs []error
		for _, x := range r.families() {
			if _, err := x.binary("-restore"); err != nil {
				continue
			}
			errs = append(errs, r.applyTable(x, "nat", nil))
		}
		// Entries of answered queries would still NAT a new query that reuses
		// their source port to the resolver: gone. Unanswered ones (in flight)
		// stay for their replies.
		_, err := deleteFlows(func(f conntrack.Flow) bool { return f.Zone == r.cfg.Zone && f.Status.SeenReply() })
		return errors.Join(append(errs, err)...)
	})
	if err != nil {
		return fmt.Errorf("remove iptables capture: %w", err)
	}
	r.cfg.Logger.Info("iptables mode capture removed; zone rules stay until the resolver drained", "backend", r.backend)
	return nil
}

// stopRepair stops the repair loop (stop may be nil: none runs) and waits
// until it has.
func stopRepair(stop func(), done <-chan struct{}) {
	if stop != nil {
		stop()
		<-done
	}
}

// Handoff tells the rules that a successor adopted them: Close then leaves
// them installed.
func (r *Rules) Handoff() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.handoff = true
}

// Close stops the repair loop and removes every rule and chain of ours (nat
// before raw, so no captured flow is left with a zone but without NAT while the
// resolver still runs) and flushes our zone's conntrack entries and any UDP
// entry still NATed to the resolver; after Handoff it removes nothing. It is
// idempotent and safe after a failed or missing Start.
func (r *Rules) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	stop, done, handoff := r.stopRun, r.runDone, r.handoff
	r.mu.Unlock()
	stopRepair(stop, done)
	r.op.Lock()
	defer r.op.Unlock()
	if r.ns == nil {
		return nil
	}
	if handoff {
		r.cfg.Logger.Info("iptables mode rules left to the successor", "backend", r.backend)
		return r.ns.close()
	}
	err := r.ns.do(func() error {
		_, err := r.removeAll()
		return err
	})
	if cerr := r.ns.close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("remove iptables rules: %w", err)
	}
	r.cfg.Logger.Info("iptables mode rules removed", "backend", r.backend)
	return nil
}

// removeAll removes everything of ours in the backend of r and flushes the
// conntrack entries of our zone; runs inside the namespace.
func (r *Rules) removeAll() ([]string, error) {
	removed, zones, targets, err := cleanupBackend(r.backend)
	zones = append(zones, r.cfg.Zone)
	for _, f := range r.cfg.fams {
		if f.captures() {
			targets = append(targets, slotTargets(f)...)
		}
	}
	n, ferr := flushZones(zones, targets)
	if n > 0 {
		removed = append(removed, fmt.Sprintf("conntrack: %d entries of zone %v or NATed to the resolver", n, slices.Compact(slices.Sorted(slices.Values(zones)))))
	}
	return removed, errors.Join(err, ferr)
}

// Cleanup removes what a crashed agent left in the calling thread's network
// namespace: every chain named MESHDNS-* in the nat and raw tables (v4 and v6)
// with the rules jumping to it, and the conntrack entries of the zones those
// chains used or still NATed to the targets they used. backend "" looks at both
// backends (a leftover may be in either); otherwise only that one. On a clean
// host it removes nothing and returns no error.
func Cleanup(backend string) (removed []string, err error) {
	var backends []string
	switch backend {
	case "":
		backends = []string{BackendLegacy, BackendNFT}
	case BackendLegacy, BackendNFT:
		backends = []string{backend}
	default:
		return nil, fmt.Errorf("cleanup: iptables backend %q: want %q, %q or empty", backend, BackendLegacy, BackendNFT)
	}
	var zones []uint16
	var targets []slotTarget
	var errs []error
	for _, b := range backends {
		rm, z, t, err := cleanupBackend(b)
		removed = append(removed, rm...)
		zones = append(zones, z...)
		targets = append(targets, t...)
		if err != nil {
			errs = append(errs, err)
		}
	}
	if len(zones) > 0 || len(targets) > 0 {
		n, err := flushZones(zones, targets)
		if err != nil {
			errs = append(errs, err)
		}
		if n > 0 {
			removed = append(removed, fmt.Sprintf("conntrack: %d entries of zone %v or NATed to the resolver", n, slices.Compact(slices.Sorted(slices.Values(zones)))))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return removed, fmt.Errorf("cleanup: %w", err)
	}
	return removed, nil
}

// cleanupBackend removes our chains from one backend (both families, nat then
// raw) and returns what it removed, the zones our raw chains set and the DNAT
// targets our nat chains used. Missing tools of a family are not an error.
func cleanupBackend(backend string) (removed []string, zones []uint16, targets []slotTarget, err error) {
	var errs []error
	for _, v6 := range []bool{false, true} {
		x := ipt{backend: backend, v6: v6}
		if _, err := x.binary("-restore"); err != nil {
			continue
		}
		for _, table := range []string{"nat", "raw"} {
			st, err := x.save(table)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			ours := st.ours()
			jumps := st.jumps()
			if len(ours) == 0 && len(jumps) == 0 {
				continue
			}
			var b strings.Builder
			fmt.Fprintf(&b, "*%s\n", table)
			for _, h := range slices.Sorted(func(yield func(string) bool) {
				for h := range jumps {
					if !yield(h) {
						return
					}
				}
			}) {
				for _, j := range jumps[h] {
					fmt.Fprintf(&b, "-D %s %s\n", h, j)
					removed = append(removed, fmt.Sprintf("%s-%s -t %s -D %s %s", x.familyName(), backend, table, h, j))
				}
			}
			for _, c := range slices.Sorted(slices.Values(ours)) {
				for _, rule := range st.rules[c] {
					zones = append(zones, ruleZones(rule)...)
					targets = append(targets, ruleTargets(rule)...)
				}
				fmt.Fprintf(&b, "-F %s\n-X %s\n", c, c)
				removed = append(removed, fmt.Sprintf("%s-%s -t %s -X %s", x.familyName(), backend, table, c))
			}
			b.WriteString("COMMIT\n")
			if err := x.restore(b.String()); err != nil {
				errs = append(errs, fmt.Errorf("%s %s table: %w", x.familyName(), table, err))
			}
		}
	}
	return removed, zones, targets, errors.Join(errs...)
}
