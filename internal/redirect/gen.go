package redirect

// The eBPF object is compiled from bpf/redirect.c with a pinned clang and committed
// (redirect_bpfel.go, redirect_bpfel.o), so building the agent needs no C toolchain.
// scripts/check-bpf-generated.sh verifies the committed files match the source.
// The second object is the watch clock of the same file (-DMESHDNS_WATCH_CLOCK):
// loaded on its own, and only where the kernel has BPF timers (watchclock.go).
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall -Werror" -target bpfel -type meshdns_config -type meshdns_progress -type ns_key -type backend -type sock_entry -type sock_origs -type flow_entry -type flow_bucket -type hook_counters -type cgroup_counters -type meshdns_limits -type meshdns_flags -type hook -type counter -type cgroup_counter -type resolver_sock_kind -type egress_rule -type egress_port -type egress_grant_key -type egress_grant -type egress_lpm_key -type egress_counters -type egress_event -type egress_rule_flags -type egress_counter -type egress_verdict redirect ../../bpf/redirect.c -- -I../../bpf/headers
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall -Werror -Wno-unused-function -DMESHDNS_WATCH_CLOCK" -target bpfel watchclock ../../bpf/redirect.c -- -I../../bpf/headers
