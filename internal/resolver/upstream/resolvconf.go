package upstream

import (
	"bufio"
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"strings"
)

// ParseResolvConf reads the nameservers (port 53) and search domains (fully qualified,
// lower-cased) of a resolv.conf file. As in the C library, the last `search` or
// `domain` line wins; comments start with '#' or ';'; options are ignored. A file without
// nameserver lines, or with one that is not an IP address, is an error.
func ParseResolvConf(path string) (servers []netip.AddrPort, search []string, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("read resolv.conf: %w", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	seen := make(map[netip.AddrPort]bool)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.IndexAny(line, "#;"); i >= 0 {
			line = line[:i]
		}
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		switch fields[0] {
		case "nameserver":
			if len(fields) != 2 {
				return nil, nil, fmt.Errorf("%s:%d: nameserver line needs exactly one address, got %q", path, n, strings.TrimSpace(line))
			}
			a, err := netip.ParseAddr(fields[1])
			if err != nil {
				return nil, nil, fmt.Errorf("%s:%d: nameserver %q is not an IP address: %w", path, n, fields[1], err)
			}
			ap := netip.AddrPortFrom(a.Unmap(), 53)
			if !seen[ap] {
				seen[ap] = true
				servers = append(servers, ap)
			}
		case "search", "domain":
			search = search[:0]
			for _, d := range fields[1:] {
				d = strings.ToLower(strings.TrimSuffix(d, "."))
				if d == "" {
					continue
				}
				search = append(search, d+".")
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(servers) == 0 {
		return nil, nil, fmt.Errorf("%s: no nameserver lines", path)
	}
	if len(search) == 0 {
		search = nil
	}
	return servers, search, nil
}
