//go:build linux

package ctzone

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"
)

// commandTimeout bounds one iptables invocation.
const commandTimeout = 30 * time.Second

// guard, when set (tests), is called before every command and netlink socket;
// it refuses to act in a namespace it must not touch.
var guard func() error

// ipt runs the iptables tools of one backend and family in the calling thread's
// network namespace.
type ipt struct {
	backend string
	v6      bool
}

func (x ipt) familyName() string {
	if x.v6 {
		return "ip6tables"
	}
	return "iptables"
}

// binary returns the path of tool ("", "-save", "-restore") for this backend:
// iptables-nft-save, or plain iptables-save when that one reports the backend.
func (x ipt) binary(tool string) (string, error) {
	base := x.familyName()
	name := base + "-" + x.backend + tool
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	plain := base + tool
	p, err := exec.LookPath(plain)
	if err != nil {
		return "", fmt.Errorf("neither %s nor %s on PATH", name, plain)
	}
	out, err := exec.Command(p, "--version").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w: %s", plain, err, bytes.TrimSpace(out))
	}
	want := "(legacy)"
	if x.backend == BackendNFT {
		want = "(nf_tables)"
	}
	if !bytes.Contains(out, []byte(want)) {
		return "", fmt.Errorf("%s not on PATH and %s is %s", name, plain, bytes.TrimSpace(out))
	}
	return p, nil
}

func (x ipt) run(stdin string, tool string, args ...string) (string, error) {
	if guard != nil {
		if err := guard(); err != nil {
			return "", err
		}
	}
	bin, err := x.binary(tool)
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if stdin != "" {
			msg += "\ninput:\n" + stdin
		}
		return stdout.String(), fmt.Errorf("%s %s: %w: %s", bin, strings.Join(args, " "), err, msg)
	}
	return stdout.String(), nil
}

// tableExists reports whether table exists in this namespace, without creating
// it (listing a missing legacy table would instantiate it).
func (x ipt) tableExists(table string) (bool, error) {
	if x.backend == BackendLegacy {
		names := "/proc/thread-self/net/ip_tables_names"
		if x.v6 {
			names = "/proc/thread-self/net/ip6_tables_names"
		}
		b, err := os.ReadFile(names)
		if errors.Is(err, os.ErrNotExist) {
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("read %s: %w", names, err)
		}
		for _, l := range strings.Fields(string(b)) {
			if l == table {
				return true, nil
			}
		}
		return false, nil
	}
	out, err := x.run("", "-save", "-t", table)
	if err != nil {
		return false, nil // nft: a missing table makes save fail
	}
	return strings.Contains(out, "*"+table), nil
}

// tableState is a parsed iptables-save of one table.
type tableState struct {
	chains map[string]bool     // every chain declared
	rules  map[string][]string // chain -> rules, each the text after "-A CHAIN "
}

func (s tableState) ours() []string {
	var names []string
	for c := range s.chains {
		if strings.HasPrefix(c, chainPrefix) {
			names = append(names, c)
		}
	}
	return names
}

// jumps returns, for each built-in chain, the rules that jump to a chain of ours.
func (s tableState) jumps() map[string][]string {
	out := map[string][]string{}
	for chain, rules := range s.rules {
		if strings.HasPrefix(chain, chainPrefix) {
			continue
		}
		for _, r := range rules {
			if target := jumpTarget(r); strings.HasPrefix(target, chainPrefix) {
				out[chain] = append(out[chain], r)
			}
		}
	}
	return out
}

func jumpTarget(rule string) string {
	f := strings.Fields(rule)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "-j" || f[i] == "-g" {
			return f[i+1]
		}
	}
	return ""
}

func parseSave(out, table string) tableState {
	s := tableState{chains: map[string]bool{}, rules: map[string][]string{}}
	in := false
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<26)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "*"):
			in = l[1:] == table
		case !in:
		case strings.HasPrefix(l, ":"):
			if f := strings.Fields(l[1:]); len(f) > 0 {
				s.chains[f[0]] = true
			}
		case strings.HasPrefix(l, "-A "):
			f := strings.SplitN(l[3:], " ", 2)
			rest := ""
			if len(f) == 2 {
				rest = f[1]
			}
			s.rules[f[0]] = append(s.rules[f[0]], rest)
		}
	}
	return s
}

// save reads one table; a table that does not exist reads as empty.
func (x ipt) save(table string) (tableState, error) {
	ok, err := x.tableExists(table)
	if err != nil || !ok {
		return parseSave("", table), err
	}
	out, err := x.run("", "-save", "-t", table)
	if err != nil {
		return tableState{}, err
	}
	return parseSave(out, table), nil
}

// restore applies a --noflush iptables-restore transaction.
func (x ipt) restore(input string) error {
	_, err := x.run(input, "-restore", "--noflush", "--wait")
	return err
}

// countRules counts the rules of every table this backend has (both families),
// without creating any, for DetectBackend.
func countRules(backend string) (int, error) {
	n := 0
	var errs []error
	for _, v6 := range []bool{false, true} {
		x := ipt{backend: backend, v6: v6}
		if _, err := x.binary("-save"); err != nil {
			if !v6 {
				errs = append(errs, err)
			}
			continue
		}
		out, err := x.run("", "-save")
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, "-") {
				n++
			}
		}
	}
	return n, errors.Join(errs...)
}
