package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
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
