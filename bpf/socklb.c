// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * A socket load balancer of the tests' own (internal/redirect/socklb), doing
 * what Cilium's bpf_sock does with kube-proxy replacement, and what Calico's
 * connect-time load balancer does: it is the "foreign program" that the
 * coexistence tests attach to the capture cgroup's hooks beside ours. Not
 * loaded by the agent.
 *
 *   connect4/6, sendmsg4/6: a destination (address, port) found in services is
 *     rewritten to its backend, and the translation is recorded in the
 *     socket's storage (Cilium records it per socket cookie in
 *     cilium_lb4_reverse_sk);
 *   recvmsg4/6, getpeername4/6: an address equal to the recorded backend is
 *     restored to the service address.
 * IPv4 addresses are kept as ::ffff:a.b.c.d in the maps, so a v6 socket to a
 * v4-mapped service is translated too. With config.tcp_only (Calico's
 * bpfConnectTimeLoadBalancing: TCP) only TCP connects are translated; UDP is
 * left to a later translation (Calico's tc programs), which is nowhere here.
 */

#include "meshdns_bpf.h"

struct lb_addr {
	__u32 addr[4];
	__u16 port; /* network byte order */
	__u16 pad;
};

struct lb_config {
	__u32 tcp_only;
};

/* Rows of the stats array. */
enum lb_counter {
	LB_TRANSLATED,
	LB_RESTORED,
	LB_NUM_COUNTERS,
};

struct lb_revnat {
	struct lb_addr service;
	struct lb_addr backend;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_addr);
	__type(value, struct lb_addr);
	__uint(max_entries, 64);
} services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_config);
	__uint(max_entries, 1);
} lb_settings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, LB_NUM_COUNTERS);
} lb_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct lb_revnat);
} revnat SEC(".maps");

/* BTF anchor for bpf2go -type (see redirect.c). */
struct lb_enums {
	enum lb_counter counter;
};
struct lb_enums *lb_enums_anchor __attribute__((unused));

static __always_inline void lb_count(__u32 counter)
{
	__u64 *c = bpf_map_lookup_elem(&lb_stats, &counter);
	if (c)
		__sync_fetch_and_add(c, 1);
}

static __always_inline int lb_same(const struct lb_addr *a, const struct lb_addr *b)
{
	return a->addr[0] == b->addr[0] && a->addr[1] == b->addr[1] && a->addr[2] == b->addr[2] &&
	       a->addr[3] == b->addr[3] && a->port == b->port;
}

/* Looks dst up; on a hit records the translation and fills be. */
static __always_inline int lb_translate(struct bpf_sock_addr *ctx, struct lb_addr *dst, struct lb_addr *be)
{
	__u32 zero = 0;
	struct lb_config *cfg = bpf_map_lookup_elem(&lb_settings, &zero);
	struct lb_addr *hit;
	struct lb_revnat *rn;
	struct bpf_sock *sk;

	if (!cfg || (cfg->tcp_only && ctx->type != SOCK_STREAM))
		return 0;
	hit = bpf_map_lookup_elem(&services, dst);
	if (!hit)
		return 0;
	sk = ctx->sk;
	if (!sk)
		return 0;
	rn = bpf_sk_storage_get(&revnat, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!rn)
		return 0;
	rn->service = *dst;
	rn->backend = *hit;
	*be = *hit;
	lb_count(LB_TRANSLATED);
	return 1;
}

/* Fills orig with the service address when src is this socket's backend. */
static __always_inline int lb_restore(struct bpf_sock_addr *ctx, struct lb_addr *src, struct lb_addr *orig)
{
	struct lb_revnat *rn;
	struct bpf_sock *sk = ctx->sk;

	if (!sk)
		return 0;
	rn = bpf_sk_storage_get(&revnat, sk, 0, 0);
	if (!rn || !lb_same(&rn->backend, src))
		return 0;
	*orig = rn->service;
	lb_count(LB_RESTORED);
	return 1;
}

static __always_inline void from4(struct bpf_sock_addr *ctx, struct lb_addr *a)
{
	volatile __u32 port = ctx->user_port;

	a->addr[0] = 0;
	a->addr[1] = 0;
	a->addr[2] = bpf_htonl(0x0000ffff);
	a->addr[3] = ctx->user_ip4;
	a->port = (__u16)port;
	a->pad = 0;
}

static __always_inline void from6(struct bpf_sock_addr *ctx, struct lb_addr *a)
{
	volatile __u32 port = ctx->user_port;

	a->addr[0] = ctx->user_ip6[0];
	a->addr[1] = ctx->user_ip6[1];
	a->addr[2] = ctx->user_ip6[2];
	a->addr[3] = ctx->user_ip6[3];
	a->port = (__u16)port;
	a->pad = 0;
}

static __always_inline void to4(struct bpf_sock_addr *ctx, const struct lb_addr *a)
{
	ctx->user_ip4 = a->addr[3];
	ctx->user_port = (__u32)a->port;
}

static __always_inline void to6(struct bpf_sock_addr *ctx, const struct lb_addr *a)
{
	ctx->user_ip6[0] = a->addr[0];
	barrier();
	ctx->user_ip6[1] = a->addr[1];
	barrier();
	ctx->user_ip6[2] = a->addr[2];
	barrier();
	ctx->user_ip6[3] = a->addr[3];
	ctx->user_port = (__u32)a->port;
}

static __always_inline int forward4(struct bpf_sock_addr *ctx)
{
	struct lb_addr dst = {}, be = {};

	from4(ctx, &dst);
	if (lb_translate(ctx, &dst, &be))
		to4(ctx, &be);
	return 1;
}

static __always_inline int forward6(struct bpf_sock_addr *ctx)
{
	struct lb_addr dst = {}, be = {};

	from6(ctx, &dst);
	if (lb_translate(ctx, &dst, &be))
		to6(ctx, &be);
	return 1;
}

static __always_inline int reverse4(struct bpf_sock_addr *ctx)
{
	struct lb_addr src = {}, orig = {};

	from4(ctx, &src);
	if (lb_restore(ctx, &src, &orig))
		to4(ctx, &orig);
	return 1;
}

static __always_inline int reverse6(struct bpf_sock_addr *ctx)
{
	struct lb_addr src = {}, orig = {};

	from6(ctx, &src);
	if (lb_restore(ctx, &src, &orig))
		to6(ctx, &orig);
	return 1;
}

SEC("cgroup/connect4")
int lb_connect4(struct bpf_sock_addr *ctx) { return forward4(ctx); }

SEC("cgroup/connect6")
int lb_connect6(struct bpf_sock_addr *ctx) { return forward6(ctx); }

SEC("cgroup/sendmsg4")
int lb_sendmsg4(struct bpf_sock_addr *ctx) { return forward4(ctx); }

SEC("cgroup/sendmsg6")
int lb_sendmsg6(struct bpf_sock_addr *ctx) { return forward6(ctx); }

SEC("cgroup/recvmsg4")
int lb_recvmsg4(struct bpf_sock_addr *ctx) { return reverse4(ctx); }

SEC("cgroup/recvmsg6")
int lb_recvmsg6(struct bpf_sock_addr *ctx) { return reverse6(ctx); }

SEC("cgroup/getpeername4")
int lb_getpeername4(struct bpf_sock_addr *ctx) { return reverse4(ctx); }

SEC("cgroup/getpeername6")
int lb_getpeername6(struct bpf_sock_addr *ctx) { return reverse6(ctx); }

char LICENSE[] SEC("license") = "Dual BSD/GPL";
