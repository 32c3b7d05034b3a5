package ctzone

import (
	"fmt"
	"strings"
	"testing"

	"github.com/meshdns/meshdns-ebpf/internal/testenv"
)

// TestDetectBackend: the backend holding more rules in the namespace wins, nft
// when neither holds any; Install with Backend "" then uses that one only.
func TestDetectBackend(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "iptables-legacy", "iptables-nft", "ip6tables-legacy", "ip6tables-nft")
	for _, tc := range []struct {
		name              string
		legacyRules, nfts int
		want              string
	}{
		{"empty", 0, 0, BackendNFT},
		{"legacy rules", 3, 0, BackendLegacy},
		{"nft rules", 0, 3, BackendNFT},
		{"more nft", 2, 5, BackendNFT},
		{"more legacy", 5, 2, BackendLegacy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.NewNetns(t, "mdct-det")
			for i := 0; i < tc.legacyRules; i++ {
				ns.Exec(t, "iptables-legacy", "-w", "-A", "INPUT", "-p", "tcp", "--dport", fmt.Sprint(9000+i), "-j", "ACCEPT")
			}
			for i := 0; i < tc.nfts; i++ {
				ns.Exec(t, "iptables-nft", "-w", "-A", "INPUT", "-p", "tcp", "--dport", fmt.Sprint(9000+i), "-j", "ACCEPT")
			}
			var got string
			if err := ns.Do(func() (err error) { got, err = DetectBackend(); return err }); err != nil {
				t.Fatalf("DetectBackend: %v", err)
			}
			if got != tc.want {
				t.Fatalf("DetectBackend = %q, want %q", got, tc.want)
			}
			// Install with detection lands in that backend and not the other.
			r := mustInstall(t, ns, Config{ListenAddr: ctzoneTestListen, CaptureAll: true})
			if r.Backend() != tc.want {
				t.Errorf("Install used backend %q, want %q", r.Backend(), tc.want)
			}
			other := BackendLegacy
			if tc.want == BackendLegacy {
				other = BackendNFT
			}
			if ours := saveOurs(t, ns.Name, tc.want, true); !strings.Contains(ours, chainOutput) {
				t.Errorf("no rules of ours in %s:\n%s", tc.want, ours)
			}
			if ours := saveOurs(t, ns.Name, other, true); ours != "" {
				t.Errorf("rules of ours in %s too:\n%s", other, ours)
			}
			if err := r.Close(); err != nil {
				t.Fatalf("Close: %v", err)
			}
		})
	}
}

// TestProbe: a namespace of this kernel can do iptables mode, and the probe
// leaves nothing behind.
func TestProbe(t *testing.T) {
	testenv.RequirePrivileged(t, "ip", "iptables-legacy", "iptables-nft")
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			ns := testenv.NewNetns(t, "mdct-probe")
			backend := BackendNFT
			if legacy {
				backend = BackendLegacy
				for i := 0; i < 3; i++ {
					ns.Exec(t, "iptables-legacy", "-w", "-A", "INPUT", "-p", "tcp", "--dport", fmt.Sprint(9000+i), "-j", "ACCEPT")
				}
			}
			if err := ns.Do(func() error { return Probe("") }); err != nil {
				t.Fatalf("Probe: %v", err)
			}
			for _, b := range []string{BackendLegacy, BackendNFT} {
				if left := saveOurs(t, ns.Name, b, true); left != "" {
					t.Errorf("Probe (%s) left in %s:\n%s", backend, b, left)
				}
			}
		})
	}
}
