package testenv

// ModeCaps are the only capabilities an agent gets in each --mode in the test
// suites (test/e2e runs every agent under setpriv with exactly these), and what
// the shipped DaemonSet grants (test/deploy compares its container's
// capabilities with them), so the manifests promise no more and no less than
// what the end-to-end suites pass with. Names are setpriv's (lower case, no
// CAP_ prefix).
var ModeCaps = map[string][]string{
	"ebpf":     {"bpf", "net_admin", "net_bind_service"},
	"iptables": {"net_admin", "net_raw", "net_bind_service"},
	"auto":     {"bpf", "net_admin", "net_raw", "net_bind_service"},
	"off":      {"net_bind_service"},
}
