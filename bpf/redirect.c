// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * meshdns-ebpf datapath: cgroup sock_addr programs that send port-53 traffic of
 * every process in a cgroup subtree to the node's resolver, and make replies
 * look as if they came from the nameserver the application asked.
 *
 * Forward (connect4/6: TCP and connected UDP; sendmsg4/6: unconnected UDP):
 *   dst port != 53                                    -> pass, not counted
 *   agent not ready or heartbeat older than 600ms      -> skip_not_ready
 *   loopback dst and not capture-loopback             -> skip_loopback
 *   dst is one of our targets                         -> pass, not counted
 *   SO_MARK == upstream mark (the resolver itself)    -> skip_resolver
 *   calling task's UID is a proxy UID                 -> skip_proxy
 *   dst not a captured nameserver, not capture-all    -> skip_not_captured
 *   target is loopback, socket in another netns       -> skip_other_netns
 *   else remember (cookie, slot port) -> original dst, rewrite dst to
 *   target:slot port                                  -> redirected_udp/_tcp
 * Reverse (recvmsg4/6: reply source; getpeername4/6: peer): when the address is
 * a target:slot port, restore the original for this socket (reply_rewritten) or
 * count map_miss. sock_release deletes the socket's entries.
 *
 * All configuration lives in maps the agent writes; nothing is compiled in.
 */

#include "meshdns_bpf.h"

#define DNS_PORT 53
#define MAX_NAMESERVERS 32
#define MAX_SLOTS (MAX_NAMESERVERS + 1)
#define HEARTBEAT_TIMEOUT_NS 600000000ULL

/* config.flags */
#define FLAG_TARGET4 (1U << 0)          /* target4 is set */
#define FLAG_TARGET6 (1U << 1)          /* target6 is set */
#define FLAG_CAPTURE_ALL (1U << 2)      /* capture every port-53 destination */
#define FLAG_CAPTURE_LOOPBACK (1U << 3) /* also capture loopback destinations */
#define FLAG_TARGET4_LOOPBACK (1U << 4) /* target4 is in 127.0.0.0/8 */
#define FLAG_TARGET6_LOOPBACK (1U << 5) /* target6 is ::1 */

/* internal/redirect mirrors these enums (names and order); a test compares them. */
enum hook {
	HOOK_CONNECT4,
	HOOK_CONNECT6,
	HOOK_SENDMSG4,
	HOOK_SENDMSG6,
	HOOK_RECVMSG4,
	HOOK_RECVMSG6,
	HOOK_GETPEERNAME4,
	HOOK_GETPEERNAME6,
	HOOK_SOCK_RELEASE,
	NUM_HOOKS,
};

enum counter {
	COUNTER_REDIRECTED_UDP,
	COUNTER_REDIRECTED_TCP,
	COUNTER_REPLY_REWRITTEN,
	COUNTER_SKIP_PROXY,
	COUNTER_SKIP_RESOLVER,
	COUNTER_SKIP_NOT_READY,
	COUNTER_SKIP_NOT_CAPTURED,
	COUNTER_SKIP_LOOPBACK,
	COUNTER_SKIP_OTHER_NETNS,
	COUNTER_MAP_MISS,
	COUNTER_MAP_ERROR,
	NUM_COUNTERS,
};

enum cgroup_counter {
	CGROUP_REDIRECTED_UDP,
	CGROUP_REDIRECTED_TCP,
	CGROUP_REPLY_REWRITTEN,
	CGROUP_SKIPPED,
	NUM_CGROUP_COUNTERS,
};

/* Written by the agent; one entry. Addresses in network byte order. */
struct meshdns_config {
	__u32 target4;
	__u32 target6[4];
	__u16 base_port;     /* slot 0 port, host byte order */
	__u16 num_slots;     /* slots in use, including the capture-all slot */
	__u16 all_slot;      /* slot of capture-all destinations */
	__u16 pad0;
	__u32 flags;         /* FLAG_* */
	__u32 upstream_mark; /* SO_MARK of the resolver's own upstream sockets */
	__u32 pad1;
	__u64 agent_netns_cookie;
};

/* Written by the agent; one entry. */
struct meshdns_state {
	__u32 ready;
	__u32 pad0;
	__u64 heartbeat_ns; /* CLOCK_MONOTONIC, as bpf_ktime_get_ns */
};

/* A nameserver address; IPv4 as ::ffff:a.b.c.d. */
struct ns_key {
	__u32 addr[4];
};

struct orig_key {
	__u64 cookie;   /* socket cookie */
	__u16 port;     /* slot port the socket was sent to, host byte order */
	__u16 pad0;
	__u32 pad1;
};

struct orig_val {
	__u32 addr[4]; /* original destination; IPv4 as ::ffff:a.b.c.d */
	__u16 port;    /* original port, network byte order */
	__u16 pad0;
	__u32 pad1;
};

struct hook_counters {
	__u64 counters[NUM_COUNTERS];
};

struct cgroup_counters {
	__u64 counters[NUM_CGROUP_COUNTERS];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct meshdns_config);
	__uint(max_entries, 1);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct meshdns_state);
	__uint(max_entries, 1);
} state SEC(".maps");

/* Captured nameserver -> slot. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct ns_key);
	__type(value, __u32);
	__uint(max_entries, MAX_NAMESERVERS);
} nameservers SEC(".maps");

/* UIDs whose sockets are never captured (value unused). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 64);
} proxy_uids SEC(".maps");

/* (socket cookie, slot port) -> original destination. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct orig_key);
	__type(value, struct orig_val);
	__uint(max_entries, 65536);
} orig_dst SEC(".maps");

/* Indexed by enum hook. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct hook_counters);
	__uint(max_entries, NUM_HOOKS);
} stats SEC(".maps");

/* Keyed by cgroup v2 id of the calling task. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_PERCPU_HASH);
	__type(key, __u64);
	__type(value, struct cgroup_counters);
	__uint(max_entries, 16384);
} cgroup_stats SEC(".maps");

static __always_inline void count(__u32 hook, __u32 counter)
{
	struct hook_counters *c = bpf_map_lookup_elem(&stats, &hook);
	if (c && counter < NUM_COUNTERS)
		__sync_fetch_and_add(&c->counters[counter], 1);
}

static __always_inline void count_cgroup(__u32 counter)
{
	__u64 id = bpf_get_current_cgroup_id();
	struct cgroup_counters *c;

	if (counter >= NUM_CGROUP_COUNTERS)
		return;
	c = bpf_map_lookup_elem(&cgroup_stats, &id);
	if (!c) {
		struct cgroup_counters init = {};
		init.counters[counter] = 1;
		if (bpf_map_update_elem(&cgroup_stats, &id, &init, BPF_NOEXIST) == 0)
			return;
		c = bpf_map_lookup_elem(&cgroup_stats, &id);
		if (!c)
			return;
	}
	__sync_fetch_and_add(&c->counters[counter], 1);
}

static __always_inline void skip(__u32 hook, __u32 counter)
{
	count(hook, counter);
	count_cgroup(CGROUP_SKIPPED);
}

static __always_inline struct meshdns_config *get_config(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&config, &zero);
}

/* Capture only while the agent is ready and its heartbeat is fresh. */
static __always_inline int agent_alive(void)
{
	__u32 zero = 0;
	struct meshdns_state *s = bpf_map_lookup_elem(&state, &zero);
	__u64 now, hb;

	if (!s || !s->ready)
		return 0;
	hb = s->heartbeat_ns;
	now = bpf_ktime_get_ns();
	if (hb > now)
		return 1; /* written between our read of now and of hb */
	return now - hb <= HEARTBEAT_TIMEOUT_NS;
}

static __always_inline int is_v4_loopback(__u32 ip4)
{
	return (bpf_ntohl(ip4) >> 24) == 127;
}

static __always_inline int is_v6_loopback(const __u32 *a)
{
	return a[0] == 0 && a[1] == 0 && a[2] == 0 && a[3] == bpf_htonl(1);
}

static __always_inline int is_v4_mapped(const __u32 *a)
{
	return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0x0000ffff);
}

static __always_inline int v6_equal(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/*
 * The family-independent part of the forward decision. dst is the destination
 * (IPv4 as ::ffff:a.b.c.d), v4 says whether the rewrite goes to target4. Returns
 * the slot port to redirect to, or 0 to leave the socket alone (counted).
 */
static __always_inline __u16 decide(struct bpf_sock_addr *ctx, __u32 hook, struct meshdns_config *cfg,
				    const __u32 *dst, int v4)
{
	struct ns_key key = {};
	__u32 *slot, uid, mark = 0, s;
	int target_loopback;

	if (!agent_alive()) {
		skip(hook, COUNTER_SKIP_NOT_READY);
		return 0;
	}
	if (!(cfg->flags & FLAG_CAPTURE_LOOPBACK) &&
	    (v4 ? is_v4_loopback(dst[3]) : is_v6_loopback(dst))) {
		skip(hook, COUNTER_SKIP_LOOPBACK);
		return 0;
	}
	if (v4) {
		if (!(cfg->flags & FLAG_TARGET4)) {
			skip(hook, COUNTER_SKIP_NOT_CAPTURED);
			return 0;
		}
		if (dst[3] == cfg->target4)
			return 0; /* already going to the resolver */
		target_loopback = cfg->flags & FLAG_TARGET4_LOOPBACK;
	} else {
		if (!(cfg->flags & FLAG_TARGET6)) {
			skip(hook, COUNTER_SKIP_NOT_CAPTURED);
			return 0;
		}
		if (v6_equal(dst, cfg->target6))
			return 0;
		target_loopback = cfg->flags & FLAG_TARGET6_LOOPBACK;
	}
	if (bpf_getsockopt(ctx, SOL_SOCKET, SO_MARK, &mark, sizeof(mark)) == 0 &&
	    cfg->upstream_mark != 0 && mark == cfg->upstream_mark) {
		skip(hook, COUNTER_SKIP_RESOLVER);
		return 0;
	}
	uid = (__u32)bpf_get_current_uid_gid();
	if (bpf_map_lookup_elem(&proxy_uids, &uid)) {
		skip(hook, COUNTER_SKIP_PROXY);
		return 0;
	}
	key.addr[0] = dst[0];
	key.addr[1] = dst[1];
	key.addr[2] = dst[2];
	key.addr[3] = dst[3];
	slot = bpf_map_lookup_elem(&nameservers, &key);
	if (slot) {
		s = *slot;
	} else if (cfg->flags & FLAG_CAPTURE_ALL) {
		s = cfg->all_slot;
	} else {
		skip(hook, COUNTER_SKIP_NOT_CAPTURED);
		return 0;
	}
	if (s >= cfg->num_slots || s >= MAX_SLOTS) {
		skip(hook, COUNTER_SKIP_NOT_CAPTURED);
		return 0;
	}
	if (target_loopback && bpf_get_netns_cookie(ctx) != cfg->agent_netns_cookie) {
		skip(hook, COUNTER_SKIP_OTHER_NETNS);
		return 0;
	}
	return cfg->base_port + s;
}

/* Remember where the socket meant to go; 0 on success. */
static __always_inline int remember(struct bpf_sock_addr *ctx, __u32 hook, __u16 slot_port,
				    const __u32 *dst, __u16 dst_port_be)
{
	struct orig_key key = {};
	struct orig_val val = {};
	struct orig_val *old;

	key.cookie = bpf_get_socket_cookie(ctx);
	key.port = slot_port;
	val.addr[0] = dst[0];
	val.addr[1] = dst[1];
	val.addr[2] = dst[2];
	val.addr[3] = dst[3];
	val.port = dst_port_be;
	old = bpf_map_lookup_elem(&orig_dst, &key);
	if (old && v6_equal(old->addr, val.addr) && old->port == val.port)
		return 0; /* sendmsg on the same socket again: nothing to write */
	if (bpf_map_update_elem(&orig_dst, &key, &val, BPF_ANY) != 0) {
		count(hook, COUNTER_MAP_ERROR);
		return -1;
	}
	return 0;
}

static __always_inline void count_redirect(struct bpf_sock_addr *ctx, __u32 hook)
{
	__u32 type = ctx->type;

	if (type == SOCK_STREAM) {
		count(hook, COUNTER_REDIRECTED_TCP);
		count_cgroup(CGROUP_REDIRECTED_TCP);
	} else {
		count(hook, COUNTER_REDIRECTED_UDP);
		count_cgroup(CGROUP_REDIRECTED_UDP);
	}
}

static __always_inline int forward4(struct bpf_sock_addr *ctx, __u32 hook)
{
	volatile __u32 port = ctx->user_port; /* full 4-byte load */
	struct meshdns_config *cfg;
	__u32 dst[4];
	__u16 slot_port;

	if (bpf_ntohs((__u16)port) != DNS_PORT)
		return 1;
	cfg = get_config();
	if (!cfg)
		return 1;
	dst[0] = 0;
	dst[1] = 0;
	dst[2] = bpf_htonl(0x0000ffff);
	dst[3] = ctx->user_ip4;
	slot_port = decide(ctx, hook, cfg, dst, 1);
	if (!slot_port)
		return 1;
	if (remember(ctx, hook, slot_port, dst, (__u16)port) != 0)
		return 1; /* without the entry the reply could not be restored */
	ctx->user_ip4 = cfg->target4;
	ctx->user_port = (__u32)bpf_htons(slot_port);
	count_redirect(ctx, hook);
	return 1;
}

static __always_inline int forward6(struct bpf_sock_addr *ctx, __u32 hook)
{
	volatile __u32 port = ctx->user_port;
	struct meshdns_config *cfg;
	__u32 dst[4];
	__u16 slot_port;
	int v4;

	if (bpf_ntohs((__u16)port) != DNS_PORT)
		return 1;
	cfg = get_config();
	if (!cfg)
		return 1;
	dst[0] = ctx->user_ip6[0];
	dst[1] = ctx->user_ip6[1];
	dst[2] = ctx->user_ip6[2];
	dst[3] = ctx->user_ip6[3];
	v4 = is_v4_mapped(dst); /* a v4 query in disguise */
	slot_port = decide(ctx, hook, cfg, dst, v4);
	if (!slot_port)
		return 1;
	if (remember(ctx, hook, slot_port, dst, (__u16)port) != 0)
		return 1;
	if (v4) {
		ctx->user_ip6[0] = 0;
		barrier();
		ctx->user_ip6[1] = 0;
		barrier();
		ctx->user_ip6[2] = bpf_htonl(0x0000ffff);
		barrier();
		ctx->user_ip6[3] = cfg->target4;
	} else {
		ctx->user_ip6[0] = cfg->target6[0];
		barrier();
		ctx->user_ip6[1] = cfg->target6[1];
		barrier();
		ctx->user_ip6[2] = cfg->target6[2];
		barrier();
		ctx->user_ip6[3] = cfg->target6[3];
	}
	ctx->user_port = (__u32)bpf_htons(slot_port);
	count_redirect(ctx, hook);
	return 1;
}

/* The slot port if port (host byte order) is one of ours, else 0. */
static __always_inline __u16 slot_port_of(struct meshdns_config *cfg, __u16 port)
{
	if (port < cfg->base_port || port >= (__u32)cfg->base_port + cfg->num_slots)
		return 0;
	return port;
}

static __always_inline struct orig_val *lookup_orig(struct bpf_sock_addr *ctx, __u32 hook, __u16 slot_port)
{
	struct orig_key key = {};
	struct orig_val *val;

	key.cookie = bpf_get_socket_cookie(ctx);
	key.port = slot_port;
	val = bpf_map_lookup_elem(&orig_dst, &key);
	if (!val)
		count(hook, COUNTER_MAP_MISS);
	return val;
}

static __always_inline int reverse4(struct bpf_sock_addr *ctx, __u32 hook)
{
	volatile __u32 port = ctx->user_port;
	struct meshdns_config *cfg = get_config();
	struct orig_val *orig;
	__u16 slot_port;

	if (!cfg || !(cfg->flags & FLAG_TARGET4) || ctx->user_ip4 != cfg->target4)
		return 1;
	slot_port = slot_port_of(cfg, bpf_ntohs((__u16)port));
	if (!slot_port)
		return 1;
	orig = lookup_orig(ctx, hook, slot_port);
	if (!orig)
		return 1;
	ctx->user_ip4 = orig->addr[3];
	ctx->user_port = (__u32)orig->port;
	count(hook, COUNTER_REPLY_REWRITTEN);
	count_cgroup(CGROUP_REPLY_REWRITTEN);
	return 1;
}

static __always_inline int reverse6(struct bpf_sock_addr *ctx, __u32 hook)
{
	volatile __u32 port = ctx->user_port;
	struct meshdns_config *cfg = get_config();
	struct orig_val *orig;
	__u32 src[4];
	__u16 slot_port;

	if (!cfg)
		return 1;
	src[0] = ctx->user_ip6[0];
	src[1] = ctx->user_ip6[1];
	src[2] = ctx->user_ip6[2];
	src[3] = ctx->user_ip6[3];
	if (is_v4_mapped(src)) {
		if (!(cfg->flags & FLAG_TARGET4) || src[3] != cfg->target4)
			return 1;
	} else if (!(cfg->flags & FLAG_TARGET6) || !v6_equal(src, cfg->target6)) {
		return 1;
	}
	slot_port = slot_port_of(cfg, bpf_ntohs((__u16)port));
	if (!slot_port)
		return 1;
	orig = lookup_orig(ctx, hook, slot_port);
	if (!orig)
		return 1;
	ctx->user_ip6[0] = orig->addr[0];
	barrier();
	ctx->user_ip6[1] = orig->addr[1];
	barrier();
	ctx->user_ip6[2] = orig->addr[2];
	barrier();
	ctx->user_ip6[3] = orig->addr[3];
	ctx->user_port = (__u32)orig->port;
	count(hook, COUNTER_REPLY_REWRITTEN);
	count_cgroup(CGROUP_REPLY_REWRITTEN);
	return 1;
}

SEC("cgroup/connect4")
int connect4(struct bpf_sock_addr *ctx)
{
	return forward4(ctx, HOOK_CONNECT4);
}

SEC("cgroup/connect6")
int connect6(struct bpf_sock_addr *ctx)
{
	return forward6(ctx, HOOK_CONNECT6);
}

SEC("cgroup/sendmsg4")
int sendmsg4(struct bpf_sock_addr *ctx)
{
	return forward4(ctx, HOOK_SENDMSG4);
}

SEC("cgroup/sendmsg6")
int sendmsg6(struct bpf_sock_addr *ctx)
{
	return forward6(ctx, HOOK_SENDMSG6);
}

SEC("cgroup/recvmsg4")
int recvmsg4(struct bpf_sock_addr *ctx)
{
	return reverse4(ctx, HOOK_RECVMSG4);
}

SEC("cgroup/recvmsg6")
int recvmsg6(struct bpf_sock_addr *ctx)
{
	return reverse6(ctx, HOOK_RECVMSG6);
}

SEC("cgroup/getpeername4")
int getpeername4(struct bpf_sock_addr *ctx)
{
	return reverse4(ctx, HOOK_GETPEERNAME4);
}

SEC("cgroup/getpeername6")
int getpeername6(struct bpf_sock_addr *ctx)
{
	return reverse6(ctx, HOOK_GETPEERNAME6);
}

SEC("cgroup/sock_release")
int sock_release(struct bpf_sock *sk)
{
	struct meshdns_config *cfg;
	struct orig_key key = {};
	__u32 family = sk->family, type = sk->type, n, i;
	long err;

	if (family != AF_INET && family != AF_INET6)
		return 1;
	if (type != SOCK_DGRAM && type != SOCK_STREAM)
		return 1;
	cfg = get_config();
	if (!cfg)
		return 1;
	n = cfg->num_slots;
	key.cookie = bpf_get_socket_cookie(sk);
	for (i = 0; i < MAX_SLOTS; i++) {
		if (i >= n)
			break;
		key.port = cfg->base_port + i;
		err = bpf_map_delete_elem(&orig_dst, &key);
		if (err != 0 && err != -ENOENT)
			count(HOOK_SOCK_RELEASE, COUNTER_MAP_ERROR);
	}
	return 1;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
