package meshdata

import (
	"encoding/json"
	"fmt"
	"strings"
)

// ZoneFile is a zone with only the mesh SOA and NS: CoreDNS's file plugin
// serves it behind hosts(fallthrough), so names under the mesh zone that are not
// in the table get NXDOMAIN with this SOA (hosts alone would say SERVFAIL).
func ZoneFile() string {
	return fmt.Sprintf("$ORIGIN %s\n%s\n@ %d IN NS ns.dns.%s\nns.dns %d IN A 127.0.0.1\n",
		Zone, SOA(), MeshTTL, Zone, MeshTTL)
}

// CorefileHosts is the minimal CoreDNS chain: hosts (the table) + file (SOA-backed
// NXDOMAIN for the rest of the mesh zone), and cache + forward for everything else.
func CorefileHosts(port int, hostsPath, zonePath, upstream string) string {
	z := strings.TrimSuffix(Zone, ".")
	return fmt.Sprintf(`%[1]s:%[2]d {
    bind 127.0.0.1
    hosts %[3]s %[1]s {
        ttl %[6]d
        no_reverse
        reload 0
        fallthrough
    }
    file %[4]s %[1]s
}
.:%[2]d {
    bind 127.0.0.1
    cache
    forward . %[5]s
}
`, z, port, hostsPath, zonePath, upstream, MeshTTL)
}

// ProdPorts are the side ports of the production-style CoreDNS chain.
type ProdPorts struct{ Health, Ready, Prometheus int }

// CorefileProd is the production-style chain (shape of the default Kubernetes
// Corefile: errors, health, ready, cache, forward, prometheus, loop, reload,
// loadbalance) with hosts + file serving the mesh table instead of the
// kubernetes plugin.
func CorefileProd(port int, side ProdPorts, hostsPath, zonePath, upstream string) string {
	z := strings.TrimSuffix(Zone, ".")
	return fmt.Sprintf(`.:%[2]d {
    bind 127.0.0.1
    errors
    health 127.0.0.1:%[6]d {
        lameduck 5s
    }
    ready 127.0.0.1:%[7]d
    hosts %[3]s %[1]s {
        ttl %[9]d
        no_reverse
        fallthrough
    }
    file %[4]s %[1]s
    prometheus 127.0.0.1:%[8]d
    forward . %[5]s {
        max_concurrent 1000
    }
    cache 30
    loop
    reload
    loadbalance
}
`, z, port, hostsPath, zonePath, upstream, side.Health, side.Ready, side.Prometheus, MeshTTL)
}

// UnboundConf runs unbound with one thread, the table as static local-data with
// the mesh SOA, and everything else forwarded (no validation) to upstream.
func (t Table) UnboundConf(port int, dir string, upstreamHost string, upstreamPort int) string {
	var b strings.Builder
	fmt.Fprintf(&b, `server:
    interface: 127.0.0.1@%[1]d
    port: %[1]d
    do-ip6: no
    num-threads: 1
    username: ""
    chroot: ""
    directory: "%[2]s"
    pidfile: ""
    use-syslog: no
    logfile: ""
    verbosity: 0
    do-daemonize: no
    module-config: "iterator"
    do-not-query-localhost: no
    access-control: 127.0.0.0/8 allow
    msg-cache-size: 64m
    rrset-cache-size: 128m
    local-zone: "%[3]s" static
    local-data: "%[4]s"
`, port, dir, Zone, SOA())
	for _, s := range t.Services {
		fmt.Fprintf(&b, "    local-data: \"%s %d IN A %s\"\n", s.FQDN(), MeshTTL, s.IP)
	}
	fmt.Fprintf(&b, `remote-control:
    control-enable: no
forward-zone:
    name: "."
    forward-addr: %s@%d
`, upstreamHost, upstreamPort)
	return b.String()
}

// DnsmasqArgs runs dnsmasq in the foreground with the table as addn-hosts, the
// mesh zone local-only (NXDOMAIN for the rest), and a 10k-entry cache in front of
// upstream ("ip#port").
func DnsmasqArgs(port int, hostsPath, upstream string) []string {
	z := strings.TrimSuffix(Zone, ".")
	return []string{
		"--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
		"--user=root", "--pid-file=", "--bind-interfaces", "--listen-address=127.0.0.1",
		fmt.Sprintf("--port=%d", port), "--addn-hosts=" + hostsPath, "--local=/" + z + "/",
		"--server=" + upstream, "--cache-size=10000", fmt.Sprintf("--local-ttl=%d", MeshTTL),
		"--dns-forward-max=1000", "--log-facility=-",
	}
}

// NameTableEntry is one host of meshdns's JSON name table.
type NameTableEntry struct {
	IPs       []string `json:"ips"`
	Registry  string   `json:"registry"`
	Shortname string   `json:"shortname"`
	Namespace string   `json:"namespace"`
}

// NameTableJSON renders the table in meshdns's name-table format:
// {"table": {"<fqdn without dot>": {"ips": [...], "registry": "Kubernetes",
// "shortname": ..., "namespace": ...}}}.
func (t Table) NameTableJSON() ([]byte, error) {
	tab := make(map[string]NameTableEntry, len(t.Services))
	for _, s := range t.Services {
		tab[strings.TrimSuffix(s.FQDN(), ".")] = NameTableEntry{
			IPs: []string{s.IP.String()}, Registry: "Kubernetes", Shortname: s.Name, Namespace: s.Namespace,
		}
	}
	out, err := json.Marshal(map[string]any{"table": tab})
	if err != nil {
		return nil, fmt.Errorf("marshal name table: %w", err)
	}
	return out, nil
}
