package upstream

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParseResolvConf(t *testing.T) {
	ap := netip.MustParseAddrPort
	cases := []struct {
		name        string
		content     string
		wantServers []netip.AddrPort
		wantSearch  []string
		wantErr     string
	}{
		{
			name:        "kubernetes pod",
			content:     "search ns1.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\noptions ndots:5\n",
			wantServers: []netip.AddrPort{ap("10.96.0.10:53")},
			wantSearch:  []string{"ns1.svc.cluster.local.", "svc.cluster.local.", "cluster.local."},
		},
		{
			name:        "several servers, v6, comments, duplicates",
			content:     "# generated\nnameserver 10.0.0.1 # primary\n; old\nnameserver 2001:db8::53\nnameserver 10.0.0.1\nnameserver ::ffff:10.0.0.2\n",
			wantServers: []netip.AddrPort{ap("10.0.0.1:53"), ap("[2001:db8::53]:53"), ap("10.0.0.2:53")},
		},
		{
			name:        "last search or domain wins, case and dots normalised",
			content:     "search a.example b.example\nnameserver 192.0.2.53\ndomain Corp.Example.\n",
			wantServers: []netip.AddrPort{ap("192.0.2.53:53")},
			wantSearch:  []string{"corp.example."},
		},
		{name: "no nameserver", content: "search example.com\n", wantErr: "no nameserver lines"},
		{name: "empty", content: "", wantErr: "no nameserver lines"},
		{name: "hostname instead of address", content: "nameserver dns.example.com\n", wantErr: ":1: nameserver \"dns.example.com\" is not an IP address"},
		{name: "missing address", content: "search x\nnameserver\n", wantErr: ":2: nameserver line needs exactly one address"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "resolv.conf")
			if err := os.WriteFile(path, []byte(tc.content), 0o644); err != nil {
				t.Fatal(err)
			}
			servers, search, err := ParseResolvConf(path)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), path) {
					t.Fatalf("err %v, want one naming %s and containing %q", err, path, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(servers, tc.wantServers) || !slices.Equal(search, tc.wantSearch) {
				t.Errorf("got %v %v, want %v %v", servers, search, tc.wantServers, tc.wantSearch)
			}
		})
	}
	if _, _, err := ParseResolvConf(filepath.Join(t.TempDir(), "missing")); err == nil || !strings.Contains(err.Error(), "read resolv.conf") {
		t.Errorf("missing file: %v", err)
	}
}
