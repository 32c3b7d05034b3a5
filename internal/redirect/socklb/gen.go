package socklb

// The object is compiled from bpf/socklb.c with the agent's pinned clang and
// committed, like internal/redirect's (scripts/check-bpf-generated.sh checks it).
//go:generate go tool bpf2go -cc clang-14 -strip llvm-strip-14 -cflags "-O2 -g -Wall -Werror" -target bpfel -type lb_addr -type lb_config -type lb_counter socklb ../../../bpf/socklb.c -- -I../../../bpf/headers
