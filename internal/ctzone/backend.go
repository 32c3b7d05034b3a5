//go:build linux

package ctzone

import (
	"errors"
	"fmt"
	"os"
)

// DetectBackend says which iptables backend the host (the calling thread's
// network namespace) uses, the way kube-proxy's iptables-wrapper decides: the
// backend that already holds more rules wins, nft when neither holds any or
// legacy tools are missing. It only reads (no table is created). The caller
// must then use that backend only: rules split across both are evaluated by
// both, in an order neither tool shows.
func DetectBackend() (string, error) {
	legacy, lerr := countRules(BackendLegacy)
	nft, nerr := countRules(BackendNFT)
	switch {
	case lerr != nil && nerr != nil:
		return "", fmt.Errorf("detect iptables backend: no usable iptables tools: %w", errors.Join(lerr, nerr))
	case nerr != nil:
		return BackendLegacy, nil
	case lerr != nil:
		return BackendNFT, nil
	case legacy > nft:
		return BackendLegacy, nil
	default:
		return BackendNFT, nil
	}
}

// ipv6Enabled reports whether the kernel has IPv6 (not disabled at boot).
func ipv6Enabled() bool {
	_, err := os.Stat("/proc/thread-self/net/if_inet6")
	return err == nil
}

// Probe checks that this host (the calling thread's network namespace) can run
// iptables mode: the tools of the detected backend, the nat and raw tables with
// the DNAT and CT --zone targets and the owner and mark matches, and conntrack
// over netlink. backend is "legacy", "nft", or "" to detect it. It creates a
// scratch chain MESHDNS-PROBE in each table and removes it again. The error says
// exactly what is missing.
func Probe(backend string) error {
	if backend == "" {
		b, err := DetectBackend()
		if err != nil {
			return fmt.Errorf("iptables mode: %w", err)
		}
		backend = b
	}
	fams := []bool{false}
	if ipv6Enabled() {
		fams = append(fams, true)
	}
	for _, v6 := range fams {
		x := ipt{backend: backend, v6: v6}
		for _, tool := range []string{"", "-save", "-restore"} {
			if _, err := x.binary(tool); err != nil {
				return fmt.Errorf("iptables mode (%s backend): %w", backend, err)
			}
		}
		target, lo := "127.0.0.1:53", "127.0.0.0/8"
		if v6 {
			target, lo = "[::1]:53", "::1/128"
		}
		checks := []struct{ table, what, rules string }{
			{"nat", "nat table with owner and mark matches and DNAT",
				"-A MESHDNS-PROBE -m owner --uid-owner 0 -j RETURN\n" +
					"-A MESHDNS-PROBE -m mark --mark 0x1 -j RETURN\n" +
					"-A MESHDNS-PROBE -d " + lo + " -p udp -m udp --dport 53 -j DNAT --to-destination " + target + "\n"},
			{"raw", "raw table with CT --zone",
				"-A MESHDNS-PROBE -p udp -m udp --dport 53 -m mark --mark 0x1 -j CT --zone 1\n"},
		}
		for _, c := range checks {
			perr := x.restore("*" + c.table + "\n:MESHDNS-PROBE - [0:0]\n" + c.rules + "COMMIT\n")
			derr := x.removeProbe(c.table)
			if perr != nil {
				return fmt.Errorf("iptables mode (%s backend): %s: %s not usable: %w", backend, x.familyName(), c.what, perr)
			}
			if derr != nil {
				return fmt.Errorf("iptables mode (%s backend): remove probe chain: %w", backend, derr)
			}
		}
	}
	ct, err := dialConntrack()
	if err != nil {
		return fmt.Errorf("iptables mode: %w", err)
	}
	defer ct.Close()
	if _, err := ct.StatsGlobal(); err != nil {
		return fmt.Errorf("iptables mode: conntrack statistics over netlink: %w", err)
	}
	if _, err := ReadConntrackStatus(); err != nil {
		return fmt.Errorf("iptables mode: %w", err)
	}
	return nil
}

func (x ipt) removeProbe(table string) error {
	st, err := x.save(table)
	if err != nil {
		return err
	}
	if !st.chains["MESHDNS-PROBE"] {
		return nil
	}
	return x.restore("*" + table + "\n-F MESHDNS-PROBE\n-X MESHDNS-PROBE\nCOMMIT\n")
}
