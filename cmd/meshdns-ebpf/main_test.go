package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

func TestCLI(t *testing.T) {
	empty := t.TempDir()
	tests := []struct {
		args    []string
		wantOut string
		wantErr string
	}{
		{[]string{"version"}, "meshdns-ebpf dev", ""},
		{[]string{"help"}, "meshdns-ebpf run [flags]", ""},
		{nil, "", "a command is required"},
		{[]string{"frobnicate"}, "", `unknown command "frobnicate"`},
		{[]string{"stats", "-o", "yaml"}, "", `-o "yaml": want table or json`},
		{[]string{"stats", "--bpffs", empty + "/meshdns"}, "", "is the agent running?"},
		{[]string{"stats", "extra"}, "", `unexpected argument "extra"`},
		{[]string{"run", "--mode", "magic"}, "", `--mode "magic"`},
		{[]string{"run", "--log-level", "loud"}, "", "--log-level"},
		{[]string{"probe"}, "", "give the check: ready or live"},
		{[]string{"probe", "sideways", "--state-dir", empty}, "", `probe "sideways": want ready or live`},
		{[]string{"probe", "ready", "--state-dir", empty}, "", "no agent answers on " + empty + "/admin.sock"},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), tc.args, &stdout, &stderr)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v (stderr %s)", err, stderr.String())
			}
			if !strings.Contains(stdout.String(), tc.wantOut) {
				t.Errorf("stdout %q lacks %q", stdout.String(), tc.wantOut)
			}
		})
	}
}

// Every on/off flag of every command takes the bare form, =true and
// =false, and its bare form leaves the next argument alone. The commands'
// flag sets are caught as `CMD -h` creates them.
func TestBooleanFlagsOfEveryCommand(t *testing.T) {
	var sets []*flag.FlagSet
	flagSetCreated = func(fs *flag.FlagSet) { sets = append(sets, fs) }
	t.Cleanup(func() { flagSetCreated = nil })
	commands := []string{"run", "stats", "status", "table", "cleanup"}
	for _, cmd := range commands {
		if err := run(context.Background(), []string{cmd, "-h"}, io.Discard, io.Discard); !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("%s -h: %v", cmd, err)
		}
	}
	if len(sets) != len(commands) {
		t.Fatalf("caught %d flag sets for %d commands", len(sets), len(commands))
	}
	n := 0
	for i, fs := range sets {
		fs.VisitAll(func(f *flag.Flag) {
			if f.Value.Set("true") != nil || f.Value.Set("false") != nil || f.Value.Set("not-a-boolean") == nil {
				return // not an on/off flag
			}
			n++
			if b, ok := f.Value.(interface{ IsBoolFlag() bool }); !ok || !b.IsBoolFlag() {
				t.Errorf("%s --%s: an on/off flag that is not a boolean flag takes the next argument as its value", commands[i], f.Name)
				return
			}
			for _, args := range [][]string{{"--" + f.Name}, {"--" + f.Name + "=true"}, {"--" + f.Name + "=false"}, {"--" + f.Name, "next"}} {
				if err := fs.Parse(args); err != nil {
					t.Errorf("%s %v: %v", commands[i], args, err)
				} else if len(args) == 2 && fs.Arg(0) != "next" {
					t.Errorf("%s %v: the next argument was taken (args left %v)", commands[i], args, fs.Args())
				}
			}
		})
	}
	t.Logf("%d on/off flags over %d commands", n, len(commands))
	if n == 0 {
		t.Fatal("found no on/off flag at all: the detection is broken")
	}
}

// `run --authoritative --remote-kubeconfigs DIR` starts (resolver only,
// unprivileged ports) and becomes ready.
func TestRunWithBareAuthoritativeStarts(t *testing.T) {
	dir := t.TempDir()
	listen := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	admin := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	var stderr testenv.SyncBuffer
	go func() {
		done <- run(ctx, []string{"run", "--authoritative", "--remote-kubeconfigs", dir, "--mode", "off",
			"--listen", listen, "--admin", admin, "--upstream", "127.0.0.1:1", "--state-dir", t.TempDir()}, io.Discard, &stderr)
	}()
	ready := testenv.WaitFor(20*time.Second, func() bool {
		select {
		case err := <-done:
			t.Fatalf("run exited: %v\n%s", err, stderr.String())
		default:
		}
		resp, err := http.Get("http://" + admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	if !ready {
		t.Fatalf("not ready\n%s", stderr.String())
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("stop: %v", err)
	}
}
