package testenv

// ModeCaps are the only capabilities an agent gets in each --mode in the test
// suites (test/e2e runs every agent under setpriv with exactly these), and what
// the shipped DaemonSet grants (test/deploy compares its container's
// capabilities with them), so the manifests promise no more and no less than
// what the end-to-end suites pass with. Names are setpriv's (lower case, no
// CAP_ prefix).
// Every mode has sys_nice, for the resolver's reader threads' priority
// (resolver.Config.ReaderNice), which the agent works without.
var ModeCaps = map[string][]string{
	"ebpf":     {"bpf", "net_admin", "net_bind_service", "sys_nice"},
	"iptables": {"net_admin", "net_raw", "net_bind_service", "sys_nice"},
	"auto":     {"bpf", "net_admin", "net_raw", "net_bind_service", "sys_nice"},
	"off":      {"net_bind_service", "sys_nice"},
}
