// Package testenv holds the fixtures of meshdns-ebpf's privileged tests: the gate
// that skips (or, under CI=true, fails) a test whose kernel feature or privilege is
// missing, and scoped kernel state — cgroups, network namespaces, veth pairs, bpffs
// mounts — that every test creates for itself and removes in t.Cleanup, also when it
// fails. Nothing here touches the host's root cgroup, its network namespace or its
// iptables.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/cgroup2"
)

// InCI reports whether the tests run under CI (CI=true), where the kernel has every
// feature the suite needs, so a privileged test may not skip.
func InCI() bool {
	v := strings.ToLower(os.Getenv("CI"))
	return v == "true" || v == "1"
}

// Skip skips the test with reason, or fails it under CI=true: CI must prove the
// datapath on every run.
func Skip(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if InCI() {
		t.Fatalf("privileged test cannot run under CI=true: %s", msg)
	}
	t.Skip(msg)
}

// RequirePrivileged skips (fails under CI) unless the test runs as root and each of
// the named tools is on PATH.
func RequirePrivileged(t testing.TB, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		Skip(t, "needs root (running as uid %d)", os.Geteuid())
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			Skip(t, "needs %s on PATH (make test installs it): %v", tool, err)
		}
	}
	if _, err := cgroup2.FindMount(); err != nil {
		Skip(t, "needs a cgroup2 mount: %v", err)
	}
}

// RandSuffix returns n random hex characters, for names of test objects that must
// not collide with a parallel or leftover test run.
func RandSuffix(n int) string {
	b := make([]byte, (n+1)/2)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)[:n]
}

// OwnedName is base-t<pid>-<n random hex characters>: the name of a test object that
// records which test process made it, so that a later run can remove what a process
// killed before its cleanup ran (SIGKILL, a timeout) left behind (StaleOwner).
func OwnedName(base string, n int) string {
	return fmt.Sprintf("%s-t%d-%s", base, os.Getpid(), RandSuffix(n))
}

var ownedNameRE = regexp.MustCompile(`-t([0-9]+)-[0-9a-f]+$`)

// StaleOwner reports whether name came from OwnedName in a process that no longer
// exists. A pid reused since is taken as alive: the object stays for a later sweep.
func StaleOwner(name string) bool {
	m := ownedNameRE.FindStringSubmatch(name)
	if m == nil {
		return false
	}
	pid, err := strconv.Atoi(m[1])
	if err != nil || pid == os.Getpid() {
		return false
	}
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

// Run runs a command and fails the test with its output when it fails.
func Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}
