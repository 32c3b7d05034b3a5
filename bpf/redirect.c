// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
//go:build ignore

/*
 * meshdns-ebpf datapath: cgroup sock_addr programs that send port-53 traffic of
 * every process in a cgroup subtree to the node's resolver, and make replies
 * look as if they came from the nameserver the application asked.
 *
 * Forward (connect4/6: TCP and connected UDP; sendmsg4/6: unconnected UDP):
 *   dst port != 53                                    -> egress_check (below)
 *   loopback dst and not capture-loopback             -> skip_loopback
 *   dst is one of our targets                         -> pass, not counted
 *   SO_MARK == upstream mark (the resolver itself)    -> skip_resolver
 *   calling task's UID is a proxy UID                 -> skip_proxy
 *   dst a backend of a captured nameserver (a socket LB before ours, see
 *   backends) served in the socket's own netns (a CoreDNS pod's own query)
 *                                                     -> skip_not_captured
 *   dst not a captured nameserver nor a backend of one, not capture-all
 *                                                     -> skip_not_captured
 *   target is loopback, socket in another netns       -> skip_other_netns
 *   no resolver socket for the slot in resolver_socks -> skip_no_resolver
 *   resolver stopped dequeuing (see progress)         -> skip_stalled
 *   no room for this socket's state                   -> skip_no_state
 *   else record the original destination in the socket's storage and rewrite
 *   dst to target:slot port                           -> redirected_udp/_tcp
 * A backend is captured like its nameserver (same slot), and the nameserver,
 * not the backend, is recorded as the original: the client gets the address it
 * asked whatever order another datapath's recvmsg runs in (counted as
 * backend_captured too).
 * Reverse (recvmsg4/6: reply source; getpeername4/6: peer): when the address is
 * a target:slot port, restore the original the socket recorded for that slot
 * (reply_rewritten), or count map_miss.
 *
 * Fail-open. The agent puts one listening socket per (family, protocol, slot)
 * into resolver_socks, a SOCKMAP. The kernel removes a socket from it when the
 * socket is closed, so when the resolver's process dies (kill -9 included) the
 * programs stop redirecting at once. A resolver that is alive but no longer
 * reads its sockets (SIGSTOP, a stuck read loop) is detected from progress: the
 * resolver counts every datagram or connection it dequeues in progress.dequeued
 * (a BPF_F_MMAPABLE array, written without a syscall); the programs start a
 * watch when they redirect and see no dequeue since the previous watch, and
 * treat the resolver as stalled once a watch is older than config.stall_ns with
 * the count unchanged, twice, stall_ns / 4 apart (see resolver_stalled). A slow
 * resolver that still dequeues now and then never is. The agent sends itself an empty datagram when a watch ages without a
 * dequeue (a redirected socket that never sent anything), so a live, idle
 * resolver is not taken for a stalled one. Where the kernel has BPF timers, the
 * watch clock (at the end) restarts the watch on every dequeue, so a watch runs
 * from the last one even while nothing is redirected, and takes the programs'
 * look itself while clients ask only now and then.
 *
 * Per-socket state lives in socket-local storage (sock_state, freed with the
 * socket): it cannot be evicted, and when it cannot be allocated or the socket
 * already uses SOCK_ENTRIES slot ports, the query is not redirected; a reply can
 * never come back from the wrong source. Each slot port has its own entry, so a
 * socket querying several nameservers gets every reply source right; with
 * capture-all, each distinct destination of a socket takes one of the
 * capture-all slot ports.
 *
 * Attribution. The resolver sees a query's source address and port, not who
 * sent it. The forward programs record in the socket's storage the cgroup v2 id
 * and process of the task that connects or sends (note_sender). At connect time
 * a UDP socket has no source port yet (connect4/6 run before the kernel binds
 * one) and connected sends run no sock_addr program, so the record the resolver
 * reads is written where the port and the routed source address are known: on
 * the way out. attribute (cgroup_skb/egress) returns at once for any socket the
 * forward programs did not redirect (no socket storage); for a redirected one,
 * a packet to a target on a slot port (UDP: every datagram; TCP: every segment)
 * records, in flows, (source address, source port, protocol) -> (cgroup id,
 * process, socket cookie), unless the entry already says so. flows is a
 * BPF_F_MMAPABLE array of 4-way buckets indexed by a hash of the port and
 * protocol; the resolver reads it from its own memory, without a system call,
 * and checks each entry's checksum (a write in progress fails it). A new flow
 * takes a free way (never used or closed) or else the one written longest ago
 * (flow_evicted). sock_release marks the entries of a closed socket free
 * without erasing them: a query its sender gave up on is still attributed if
 * the resolver reads it late, until another socket takes the way or the port.
 *
 * DNS-gated egress. With FLAG_EGRESS set (the agent sets it while an egress
 * policy exists; without it the forward programs pay this one flag test), a
 * connect or sendmsg to any port other than 53 by a task whose cgroup, or one
 * of its ancestors (EGRESS_LEVELS levels from the root), is in
 * egress_workloads is decided by egress_check:
 *   protocol not TCP (MPTCP counts as TCP) nor UDP    -> pass, not counted
 *   loopback dst, or dst is one of our targets        -> pass, not counted
 *   no workload for the task's cgroup                 -> pass, not counted
 *   a live grant (workload, dst) whose ports allow it -> allowed_grant
 *   dst in egress_internal, rule not internal-in-scope-> allowed_internal
 *   rule fail-open and the agent is down (no resolver
 *   socket registered, or the resolver stalled), or a
 *   DNS query of the workload went around the agent in
 *   the last EGRESS_FAILOPEN_NS (its answer came from
 *   the original nameserver: no grant)               -> fail_open
 *   rule enforce                                      -> denied (EPERM), event
 *   else (audit)                                      -> audited (allowed), event
 * Grants are written by the agent before it releases the answer that resolved
 * them (expiry: bpf_ktime_get_ns time); egress_events is a ring buffer of
 * denied and audited connects (event_dropped counts what did not fit). A DNS
 * query redirected from a workload carries its id in the socket's storage and
 * in its flows entry, so the resolver knows whose answer it grants.
 *
 * All configuration lives in maps the agent writes; nothing is compiled in. The
 * enums and structs below are exported to Go by bpf2go (-type).
 */

#include "meshdns_bpf.h"

#define DNS_PORT 53

enum meshdns_limits {
	MAX_NAMESERVERS = 32, /* captured nameservers, one slot each */
	MAX_ALL_SLOTS = 4,    /* capture-all slots: distinct other destinations per socket */
	MAX_SLOTS = MAX_NAMESERVERS + MAX_ALL_SLOTS,
	SOCK_ENTRIES = 4,     /* slot ports one socket can be redirected to */
	MAX_PROXY_UIDS = 64,
	MAX_BACKENDS = 256,   /* backends of the captured nameservers */
	RESOLVER_SOCKS = 4 * MAX_SLOTS, /* (family, protocol, slot) */
	FLOW_WAYS = 4,                  /* entries per flows bucket */
	FLOW_BUCKET_BITS = 13,
	FLOW_BUCKETS = 1 << FLOW_BUCKET_BITS,
	EGRESS_MAX_WORKLOADS = 16384, /* selected cgroups */
	EGRESS_GRANTS = 65536,        /* default grant cap (the agent may set another) */
	EGRESS_PORTS = 8,             /* (port, protocol) pairs one grant allows; 0 pairs: any */
	EGRESS_INTERNAL = 256,        /* internal prefixes */
	EGRESS_LEVELS = 16,           /* cgroup levels walked for a workload */
	EGRESS_EVENTS_BYTES = 1 << 18, /* events ring buffer */
};

/* config.flags */
enum meshdns_flags {
	FLAG_TARGET4 = 1 << 0,          /* target4 is set */
	FLAG_TARGET6 = 1 << 1,          /* target6 is set */
	FLAG_CAPTURE_ALL = 1 << 2,      /* capture every port-53 destination */
	FLAG_CAPTURE_LOOPBACK = 1 << 3, /* also capture loopback destinations */
	FLAG_TARGET4_LOOPBACK = 1 << 4, /* target4 is in 127.0.0.0/8 */
	FLAG_TARGET6_LOOPBACK = 1 << 5, /* target6 is ::1 */
	FLAG_ATTRIBUTION = 1 << 6,      /* attribute records flows */
	FLAG_EGRESS = 1 << 7,           /* egress enforcement: see DNS-gated egress above */
};

/* egress_rule.flags */
enum egress_rule_flags {
	EGRESS_ENFORCE = 1 << 0,           /* deny (else audit: allow and record) */
	EGRESS_FAIL_CLOSED = 1 << 1,       /* keep enforcing while the agent is down */
	EGRESS_INTERNAL_IN_SCOPE = 1 << 2, /* internal destinations need a grant too */
};

/* Columns of egress_stats. */
enum egress_counter {
	EGRESS_ALLOWED_GRANT,
	EGRESS_ALLOWED_INTERNAL,
	EGRESS_DENIED,
	EGRESS_AUDITED,
	EGRESS_FAIL_OPEN,      /* allowed without a grant: fail-open rule, agent down */
	EGRESS_EVENT_DROPPED,  /* a denied or audited event the ring buffer had no room for */
	NUM_EGRESS_COUNTERS,
};

/* egress_event.verdict */
enum egress_verdict {
	VERDICT_DENIED = 1,
	VERDICT_AUDITED = 2,
};

/* Rows of the stats map. */
enum hook {
	HOOK_CONNECT4,
	HOOK_CONNECT6,
	HOOK_SENDMSG4,
	HOOK_SENDMSG6,
	HOOK_RECVMSG4,
	HOOK_RECVMSG6,
	HOOK_GETPEERNAME4,
	HOOK_GETPEERNAME6,
	HOOK_EGRESS,
	HOOK_SOCK_RELEASE,
	NUM_HOOKS,
};

/* Columns of the stats map. */
enum counter {
	COUNTER_REDIRECTED_UDP,
	COUNTER_REDIRECTED_TCP,
	COUNTER_REPLY_REWRITTEN,
	COUNTER_SKIP_PROXY,
	COUNTER_SKIP_RESOLVER,
	COUNTER_SKIP_NO_RESOLVER,
	COUNTER_SKIP_STALLED,
	COUNTER_SKIP_NOT_CAPTURED,
	COUNTER_SKIP_LOOPBACK,
	COUNTER_SKIP_OTHER_NETNS,
	COUNTER_SKIP_NO_STATE,
	COUNTER_MAP_MISS,
	COUNTER_FLOW_RECORDED, /* attribute wrote a flows entry */
	COUNTER_FLOW_EVICTED,  /* ... over the entry of another open socket */
	COUNTER_FLOW_RELEASED, /* sock_release freed a socket's entry */
	COUNTER_BACKEND_CAPTURED, /* redirected a query to a backend of a captured nameserver */
	NUM_COUNTERS,
};

enum cgroup_counter {
	CGROUP_REDIRECTED_UDP,
	CGROUP_REDIRECTED_TCP,
	CGROUP_REPLY_REWRITTEN,
	CGROUP_SKIPPED,
	NUM_CGROUP_COUNTERS,
};

/* resolver_socks index: ((family * 2) + protocol) * MAX_SLOTS + slot. */
enum resolver_sock_kind {
	RESOLVER_FAMILY_V4 = 0,
	RESOLVER_FAMILY_V6 = 1,
	RESOLVER_PROTO_UDP = 0,
	RESOLVER_PROTO_TCP = 1,
};

/*
 * BTF anchor: the helpers that use the enums above are inlined, which leaves
 * the enum types out of BTF; this pointer (never read) brings them in, so
 * bpf2go -type exports them to Go and nothing is mirrored by hand.
 */
struct meshdns_enums {
	enum meshdns_limits limits;
	enum meshdns_flags flags;
	enum hook hook;
	enum counter counter;
	enum cgroup_counter cgroup_counter;
	enum resolver_sock_kind resolver_sock_kind;
	enum egress_rule_flags egress_rule_flags;
	enum egress_counter egress_counter;
	enum egress_verdict egress_verdict;
};
struct meshdns_enums *meshdns_enums_anchor __attribute__((unused));

/* Written by the agent; one entry. Addresses in network byte order. */
struct meshdns_config {
	__u32 target4;
	__u32 target6[4];
	__u16 base_port; /* slot 0 port, host byte order */
	__u16 num_slots; /* slots in use: nameservers, then capture-all slots */
	__u16 all_slot;  /* first capture-all slot (the number of nameservers) */
	__u16 num_all;   /* capture-all slots (0 without capture-all) */
	__u32 flags;     /* enum meshdns_flags */
	__u32 upstream_mark; /* SO_MARK of the resolver's own upstream sockets */
	__u64 agent_netns_cookie;
	__u64 stall_ns; /* a watch older than this without a dequeue: stalled */
};

/*
 * One entry, memory-mapped by the agent. dequeued is written by the resolver
 * (one cache line), watch_* by the programs (another).
 */
struct meshdns_progress {
	__u64 dequeued; /* datagrams and connections the resolver read */
	__u64 pad0[7];
	__u64 watch_since; /* bpf_ktime_get_ns when the watch started; 0: none */
	__u64 watch_count; /* dequeued when the watch started */
	__u64 suspect_since; /* when a program first saw this watch past stall_ns */
	__u64 clock_tick; /* the watch clock's last tick (bpf_ktime_get_ns); 0: none ran */
	__u64 client_look; /* when a program last looked (at most once per ms) */
	__u64 client_gap; /* average time between the programs' looks (see note_client_look) */
	__u64 pad1[2];
};

/* A nameserver address; IPv4 as ::ffff:a.b.c.d. */
struct ns_key {
	__u32 addr[4];
};

/*
 * A backend of a captured nameserver (a CoreDNS pod behind the kube-dns
 * ClusterIP): where another datapath's socket load balancer ran before ours
 * (Cilium's, Calico's connect-time LB), a query to the nameserver reaches ours
 * with the backend as destination. Port 53 only, like every capture.
 */
struct backend {
	__u32 nameserver[4]; /* the captured nameserver it stands for; IPv4 as ::ffff:a.b.c.d */
	__u32 slot;          /* that nameserver's slot */
};

/* One redirected slot of a socket. */
struct sock_entry {
	__u32 addr[4]; /* original destination; IPv4 as ::ffff:a.b.c.d; port 53 */
	__u16 slot1;   /* slot + 1; 0: free */
	__u16 pad0;
};

struct sock_origs {
	struct sock_entry e[SOCK_ENTRIES];
	__u64 cgroup_id; /* cgroup v2 id of the task that last connected or sent; 0: none */
	__u32 tgid;      /* its process */
	__u16 flow_port; /* source port of the socket's flows entry (host byte order); 0: none */
	__u8 flow_proto; /* its protocol */
	__u8 pad0;
	__u32 workload;  /* egress workload of that task; 0: none */
	__u32 pad1;
};

/* Who sent from a source address and port (see Attribution above). */
struct flow_entry {
	__u32 addr[4];   /* source address as the resolver sees it; IPv4 as ::ffff:a.b.c.d */
	__u16 port;      /* source port, host byte order */
	__u8 proto;      /* IPPROTO_UDP or IPPROTO_TCP */
	__u8 pad0;
	__u32 tgid;      /* process that connected or sent */
	__u64 cgroup_id; /* its cgroup v2 id */
	__u64 cookie;    /* the socket's cookie */
	__u64 stamp;     /* bpf_ktime_get_ns of the write; 0: free (socket closed, or never used) */
	__u64 check;     /* flow_check of the fields from addr to cookie and workload; 0 while being written */
	__u32 workload;  /* the sender's egress workload; 0: none */
	__u32 pad1;
};

struct flow_bucket {
	struct flow_entry e[FLOW_WAYS];
};

struct hook_counters {
	__u64 counters[NUM_COUNTERS];
};

struct cgroup_counters {
	__u64 counters[NUM_CGROUP_COUNTERS];
};

/* A selected cgroup's workload (egress_workloads value). */
struct egress_rule {
	__u32 workload; /* never 0 */
	__u32 flags;    /* enum egress_rule_flags */
};

/* One (port, protocol) a grant allows; port 0: any port, proto 0: any protocol. */
struct egress_port {
	__u16 port; /* host byte order */
	__u8 proto; /* IPPROTO_TCP, IPPROTO_UDP, 0 */
	__u8 pad0;
};

struct egress_grant_key {
	__u32 workload;
	__u32 addr[4]; /* IPv4 as ::ffff:a.b.c.d */
};

struct egress_grant {
	__u64 expiry; /* bpf_ktime_get_ns after which it no longer allows */
	__u32 nports; /* ports in use; 0: any port and protocol */
	__u32 pad0;
	struct egress_port ports[EGRESS_PORTS];
};

/* egress_internal key: prefixlen counts the bits of addr (IPv4 as ::ffff:a.b.c.d, so 96 + its length). */
struct egress_lpm_key {
	__u32 prefixlen;
	__u32 addr[4];
};

struct egress_counters {
	__u64 counters[NUM_EGRESS_COUNTERS];
};

/* A denied or audited connect or send (egress_events record). */
struct egress_event {
	__u64 time;      /* bpf_ktime_get_ns */
	__u64 cgroup_id; /* the task's cgroup v2 id */
	__u32 workload;
	__u32 addr[4];   /* destination; IPv4 as ::ffff:a.b.c.d */
	__u16 port;      /* destination port, host byte order */
	__u8 proto;      /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 verdict;    /* enum egress_verdict */
};
/* BTF anchor of the event type (it goes to a ring buffer, which names no type). */
struct egress_event *egress_event_anchor __attribute__((unused));

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct meshdns_config);
	__uint(max_entries, 1);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct meshdns_progress);
	__uint(max_entries, 1);
} progress SEC(".maps");

/* The resolver's listening sockets; see enum resolver_sock_kind. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, RESOLVER_SOCKS);
} resolver_socks SEC(".maps");

/* Captured nameserver -> slot. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct ns_key);
	__type(value, __u32);
	__uint(max_entries, MAX_NAMESERVERS);
} nameservers SEC(".maps");

/* Backend address (IPv4 as ::ffff:a.b.c.d) -> the nameserver it serves; written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct ns_key);
	__type(value, struct backend);
	__uint(max_entries, MAX_BACKENDS);
} backends SEC(".maps");

/* UIDs whose sockets are never captured (value unused). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, MAX_PROXY_UIDS);
} proxy_uids SEC(".maps");

/* Per-socket original destinations, freed with the socket. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_origs);
} sock_state SEC(".maps");

/* Source address, port, protocol -> sender; memory-mapped by the resolver. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct flow_bucket);
	__uint(max_entries, FLOW_BUCKETS);
} flows SEC(".maps");

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

/* Selected cgroup v2 id -> its workload and rule; written by the agent. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u64);
	__type(value, struct egress_rule);
	__uint(max_entries, EGRESS_MAX_WORKLOADS);
} egress_workloads SEC(".maps");

/* (workload, address) -> grant; written by the agent before the answer leaves. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_grant_key);
	__type(value, struct egress_grant);
	__uint(max_entries, EGRESS_GRANTS);
} egress_grants SEC(".maps");

/* Cluster-internal prefixes (Pod and Service CIDRs); value unused. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct egress_lpm_key);
	__type(value, __u32);
	__uint(max_entries, EGRESS_INTERNAL);
} egress_internal SEC(".maps");

/* Workload id -> counters. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__type(key, __u32);
	__type(value, struct egress_counters);
	__uint(max_entries, EGRESS_MAX_WORKLOADS);
} egress_stats SEC(".maps");

/* Denied and audited connects and sends (struct egress_event). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, EGRESS_EVENTS_BYTES);
} egress_events SEC(".maps");

/*
 * How long after a fail-open workload's DNS query went around the agent (no
 * resolver, or a stalled one: the query reached its original nameserver, whose
 * answer no grant covers) its connects are still let through as fail_open: the
 * connect that follows such a lookup may come once the agent serves again.
 */
#define EGRESS_FAILOPEN_NS (30ULL * 1000000000ULL)

/* Fail-open workload -> until when its connects are let through (bpf_ktime_get_ns). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, EGRESS_MAX_WORKLOADS);
} egress_failopen SEC(".maps");

static __always_inline void count(enum hook hook, enum counter counter)
{
	struct hook_counters *c = bpf_map_lookup_elem(&stats, &hook);
	if (c && counter < NUM_COUNTERS)
		__sync_fetch_and_add(&c->counters[counter], 1);
}

static __always_inline void count_cgroup(enum cgroup_counter counter)
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

static __always_inline void skip(enum hook hook, enum counter counter)
{
	count(hook, counter);
	count_cgroup(CGROUP_SKIPPED);
}

static __always_inline struct meshdns_config *get_config(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&config, &zero);
}

/* Whether the resolver has a socket open for this family, protocol and slot. */
static __always_inline int resolver_listening(enum resolver_sock_kind family, enum resolver_sock_kind proto, __u32 slot)
{
	__u32 idx = ((family * 2) + proto) * MAX_SLOTS + slot;
	struct bpf_sock *sk;

	if (slot >= MAX_SLOTS)
		return 0;
	sk = bpf_map_lookup_elem(&resolver_socks, &idx);
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

/* Starts a watch at now, from dequeued. */
static __always_inline void start_watch(struct meshdns_progress *p, __u64 dequeued, __u64 now)
{
	p->watch_count = dequeued;
	p->watch_since = now;
	p->suspect_since = 0;
}

/*
 * One look at progress at now: whether the resolver stopped dequeuing: a
 * watch is running, nothing was
 * dequeued since it started, it is older than stall_ns, and it already was
 * when a program looked stall_ns / 4 ago. Otherwise a new watch starts when
 * something was dequeued since the last one (or none runs). The second look
 * gives a resolver that could not run at all for a while (the whole machine
 * paused: a VM preempted, every CPU busy) the same chance to dequeue as the
 * client that runs first afterwards: only a resolver that still does not
 * dequeue then is stalled. A frozen one is detected after 1.25 * stall_ns.
 */
static __always_inline int look(struct meshdns_config *cfg, struct meshdns_progress *p, __u64 now)
{
	__u64 since, dequeued, suspect;

	dequeued = *(volatile __u64 *)&p->dequeued;
	since = *(volatile __u64 *)&p->watch_since;
	if (since == 0 || dequeued != *(volatile __u64 *)&p->watch_count) {
		start_watch(p, dequeued, now);
		return 0;
	}
	if (since > now || now - since <= cfg->stall_ns)
		return 0; /* (since > now: started on another CPU after our read of now) */
	suspect = *(volatile __u64 *)&p->suspect_since;
	if (suspect < since || suspect > now) {
		p->suspect_since = now; /* first look past stall_ns */
		return 0;
	}
	return now - suspect > cfg->stall_ns / 4;
}

enum meshdns_looks {
	LOOK_RES_NS = 1000000,    /* client_look's resolution: 1 ms */
	LOOK_GAP_CAP_NS = 1000000000, /* longer gaps count as 1 s */
};

/*
 * Notes a program's look for the watch clock: client_look, and client_gap, a
 * moving average (weight 1/8) of the time between looks (looks closer than 1
 * ms count once). Before any look it is 1 s / 8. Racing CPUs may lose an
 * update: it only needs to tell clients that ask every few ms from clients
 * that ask now and then.
 */
static __always_inline void note_client_look(struct meshdns_progress *p, __u64 now)
{
	__u64 gap = now - *(volatile __u64 *)&p->client_look, avg;

	if (gap < LOOK_RES_NS)
		return;
	if (gap > LOOK_GAP_CAP_NS)
		gap = LOOK_GAP_CAP_NS;
	avg = *(volatile __u64 *)&p->client_gap;
	p->client_gap = avg - avg / 8 + gap / 8;
	p->client_look = now;
}

/* The programs' look, which they note for the watch clock. */
static __always_inline int resolver_stalled(struct meshdns_config *cfg)
{
	__u32 zero = 0;
	struct meshdns_progress *p = bpf_map_lookup_elem(&progress, &zero);
	__u64 now = bpf_ktime_get_ns();

	if (!p)
		return 0;
	note_client_look(p, now);
	return look(cfg, p, now);
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
 * Each entry through its own opaque pointer: clang would otherwise fold the
 * unrolled accesses back into base + i * sizeof(entry), which the verifier
 * refuses without CAP_PERFMON (Spectre v1 hardening).
 */
#define barrier_var(var) asm volatile("" : "+r"(var))

_Static_assert(SOCK_ENTRIES == 4, "claim_entry and copy_entry calls list every entry");
_Static_assert(FLOW_WAYS == 4, "record_flow and sock_release list every way");
_Static_assert(sizeof(struct flow_entry) == 64, "one flows entry per cache line");

/* Fills e with dst for slot want1 - 1 if e is free. */
static __always_inline int claim_entry(struct sock_entry *e, const __u32 *dst, __u32 want1)
{
	barrier_var(e);
	if (e->slot1 != 0)
		return 0;
	/* The address first, then the slot that publishes it. */
	e->addr[0] = dst[0];
	e->addr[1] = dst[1];
	e->addr[2] = dst[2];
	e->addr[3] = dst[3];
	barrier();
	e->slot1 = want1;
	return 1;
}

/* Copies e's address into orig if e is slot slot1 - 1. */
static __always_inline int copy_entry(struct sock_entry *e, __u32 slot1, __u32 *orig)
{
	barrier_var(e);
	if (e->slot1 != slot1)
		return 0;
	orig[0] = e->addr[0];
	orig[1] = e->addr[1];
	orig[2] = e->addr[2];
	orig[3] = e->addr[3];
	return 1;
}

/*
 * Records dst in st for a listed slot (listed1 = slot + 1) or, for a capture-all
 * destination (listed1 = 0), on the capture-all slot it already has in st or on
 * a free one. Sets *slot and returns 0, or returns -1 when the socket has no
 * room left. Every access to st uses a constant offset (the loops unroll, the
 * writes go through claim_entry): the verifier forbids variable offsets into
 * the storage without CAP_PERFMON, and the agent must not need it.
 */
static __always_inline int record_orig(struct meshdns_config *cfg, struct sock_origs *st, __u32 listed1,
				       const __u32 *dst, __u32 *slot)
{
	__u32 used = 0; /* capture-all slots this socket already uses (bit per slot) */
	__u32 want1 = listed1, i;
	int have_free = 0;

#pragma unroll
	for (i = 0; i < SOCK_ENTRIES; i++) {
		__u32 s1 = st->e[i].slot1;

		if (s1 == 0) {
			have_free = 1;
			continue;
		}
		if (listed1) {
			if (s1 == listed1) {
				*slot = s1 - 1;
				return 0;
			}
			continue;
		}
		if (s1 > cfg->all_slot && s1 - 1 - cfg->all_slot < MAX_ALL_SLOTS) {
			used |= 1U << (s1 - 1 - cfg->all_slot);
			if (v6_equal(st->e[i].addr, dst)) {
				*slot = s1 - 1;
				return 0;
			}
		}
	}
	if (!have_free)
		return -1;
	if (!listed1) {
#pragma unroll
		for (i = 0; i < MAX_ALL_SLOTS; i++) {
			if (i < cfg->num_all && !(used & (1U << i))) {
				want1 = cfg->all_slot + i + 1;
				break;
			}
		}
		if (!want1)
			return -1;
	}
	if (claim_entry(&st->e[0], dst, want1) || claim_entry(&st->e[1], dst, want1) ||
	    claim_entry(&st->e[2], dst, want1) || claim_entry(&st->e[3], dst, want1)) {
		*slot = want1 - 1;
		return 0;
	}
	return -1; /* taken meanwhile by another thread of this socket */
}

/*
 * The calling task's egress workload: the rule of the deepest of its cgroup's
 * ancestors (itself included, the root excluded) that is in egress_workloads,
 * copied into *rule; returns 0 when none is (or egress is off).
 */
static __always_inline int find_workload(struct meshdns_config *cfg, struct egress_rule *rule)
{
	struct egress_rule *r;
	int found = 0, level;
	__u64 id;

	if (!(cfg->flags & FLAG_EGRESS))
		return 0;
#pragma unroll
	for (level = 1; level <= EGRESS_LEVELS; level++) {
		id = bpf_get_current_ancestor_cgroup_id(level);
		if (id == 0)
			break; /* past the task's own cgroup */
		r = bpf_map_lookup_elem(&egress_workloads, &id);
		if (r && r->workload != 0) {
			rule->workload = r->workload;
			rule->flags = r->flags;
			found = 1;
		}
	}
	return found;
}

/*
 * A DNS query of the calling task goes around the agent (fail-open): when the
 * task is in a fail-open egress workload, its connects are let through for
 * EGRESS_FAILOPEN_NS (see egress_check).
 */
static __always_inline void note_failopen(struct meshdns_config *cfg)
{
	struct egress_rule rule = {};
	__u64 until;

	if (!find_workload(cfg, &rule) || (rule.flags & EGRESS_FAIL_CLOSED))
		return;
	until = bpf_ktime_get_ns() + EGRESS_FAILOPEN_NS;
	bpf_map_update_elem(&egress_failopen, &rule.workload, &until, BPF_ANY);
}

/* Whether a DNS query of workload went around the agent within EGRESS_FAILOPEN_NS. */
static __always_inline int failed_open_recently(__u32 workload, __u64 now)
{
	__u64 *until = bpf_map_lookup_elem(&egress_failopen, &workload);

	return until && *until > now;
}

/* Records in the socket's storage who connects or sends through it. */
static __always_inline void note_sender(struct meshdns_config *cfg, struct sock_origs *st)
{
	__u64 cg = bpf_get_current_cgroup_id();
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct egress_rule rule = {};

	if (st->cgroup_id != cg)
		st->cgroup_id = cg;
	if (st->tgid != tgid)
		st->tgid = tgid;
	find_workload(cfg, &rule);
	if (st->workload != rule.workload)
		st->workload = rule.workload;
}

/*
 * Whether a socket of the calling socket's type listens on dst port 53 in its
 * own network namespace: the sender is the backend itself (a CoreDNS pod
 * asking its own address), whose queries are never captured.
 */
static __always_inline int served_here(struct bpf_sock_addr *ctx, const __u32 *dst, int v4)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	__u32 size;

	if (v4) {
		t.ipv4.daddr = dst[3];
		t.ipv4.dport = bpf_htons(DNS_PORT);
		size = sizeof(t.ipv4);
	} else {
		t.ipv6.daddr[0] = dst[0];
		t.ipv6.daddr[1] = dst[1];
		t.ipv6.daddr[2] = dst[2];
		t.ipv6.daddr[3] = dst[3];
		t.ipv6.dport = bpf_htons(DNS_PORT);
		size = sizeof(t.ipv6);
	}
	if (ctx->type == SOCK_STREAM)
		sk = bpf_sk_lookup_tcp(ctx, &t, size, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(ctx, &t, size, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	bpf_sk_release(sk);
	return 1;
}

/*
 * The family-independent part of the forward decision. dst is the destination
 * (IPv4 as ::ffff:a.b.c.d), v4 says whether the rewrite goes to target4. Returns
 * the slot port to redirect to after recording dst in the socket's storage, or
 * 0 to leave the socket alone (counted).
 */
static __always_inline __u16 decide(struct bpf_sock_addr *ctx, __u32 hook, struct meshdns_config *cfg,
				    const __u32 *dst, int v4)
{
	struct ns_key key = {};
	struct sock_origs *st;
	struct bpf_sock *sk;
	struct backend *be = 0;
	const __u32 *orig = dst; /* what the reply must come from */
	__u32 *listed, uid, mark = 0, listed1 = 0, slot = 0, family, proto;
	int target_loopback;

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
		family = RESOLVER_FAMILY_V4;
	} else {
		if (!(cfg->flags & FLAG_TARGET6)) {
			skip(hook, COUNTER_SKIP_NOT_CAPTURED);
			return 0;
		}
		if (v6_equal(dst, cfg->target6))
			return 0;
		target_loopback = cfg->flags & FLAG_TARGET6_LOOPBACK;
		family = RESOLVER_FAMILY_V6;
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
	listed = bpf_map_lookup_elem(&nameservers, &key);
	if (listed) {
		if (*listed >= cfg->all_slot || *listed >= MAX_NAMESERVERS) {
			skip(hook, COUNTER_SKIP_NOT_CAPTURED);
			return 0;
		}
		listed1 = *listed + 1;
		slot = *listed;
	} else if ((be = bpf_map_lookup_elem(&backends, &key))) {
		if (be->slot >= cfg->all_slot || be->slot >= MAX_NAMESERVERS || served_here(ctx, dst, v4)) {
			skip(hook, COUNTER_SKIP_NOT_CAPTURED);
			return 0;
		}
		listed1 = be->slot + 1;
		slot = be->slot;
		orig = be->nameserver;
	} else if (cfg->flags & FLAG_CAPTURE_ALL && cfg->num_all > 0) {
		slot = cfg->all_slot; /* the capture-all slots share one resolver */
	} else {
		skip(hook, COUNTER_SKIP_NOT_CAPTURED);
		return 0;
	}
	if (target_loopback && bpf_get_netns_cookie(ctx) != cfg->agent_netns_cookie) {
		skip(hook, COUNTER_SKIP_OTHER_NETNS);
		return 0;
	}
	proto = ctx->type == SOCK_STREAM ? RESOLVER_PROTO_TCP : RESOLVER_PROTO_UDP;
	if (!resolver_listening(family, proto, slot)) {
		skip(hook, COUNTER_SKIP_NO_RESOLVER);
		note_failopen(cfg);
		return 0;
	}
	if (resolver_stalled(cfg)) {
		skip(hook, COUNTER_SKIP_STALLED);
		note_failopen(cfg);
		return 0;
	}
	sk = ctx->sk;
	if (!sk) {
		skip(hook, COUNTER_SKIP_NO_STATE);
		return 0;
	}
	st = bpf_sk_storage_get(&sock_state, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		skip(hook, COUNTER_SKIP_NO_STATE);
		return 0;
	}
	if (record_orig(cfg, st, listed1, orig, &slot) != 0 || slot >= cfg->num_slots || slot >= MAX_SLOTS) {
		skip(hook, COUNTER_SKIP_NO_STATE);
		return 0;
	}
	if (be)
		count(hook, COUNTER_BACKEND_CAPTURED);
	note_sender(cfg, st);
	return cfg->base_port + slot;
}

static __always_inline void count_egress(__u32 workload, enum egress_counter counter)
{
	struct egress_counters *c;

	if (counter >= NUM_EGRESS_COUNTERS)
		return;
	c = bpf_map_lookup_elem(&egress_stats, &workload);
	if (!c) {
		struct egress_counters init = {};
		init.counters[counter] = 1;
		if (bpf_map_update_elem(&egress_stats, &workload, &init, BPF_NOEXIST) == 0)
			return;
		c = bpf_map_lookup_elem(&egress_stats, &workload);
		if (!c)
			return;
	}
	__sync_fetch_and_add(&c->counters[counter], 1);
}

/* Whether p allows port (host byte order) and proto. */
static __always_inline int port_allows(const struct egress_port *p, __u16 port, __u8 proto)
{
	barrier_var(p);
	return (p->port == 0 || p->port == port) && (p->proto == 0 || p->proto == proto);
}

_Static_assert(EGRESS_PORTS == 8, "grant_allows lists every port");

/* Whether a live grant of workload allows dst, port and proto at now. */
static __always_inline int grant_allows(__u32 workload, const __u32 *dst, __u16 port, __u8 proto, __u64 now)
{
	struct egress_grant_key key = {};
	struct egress_grant *g;
	__u32 n;

	key.workload = workload;
	key.addr[0] = dst[0];
	key.addr[1] = dst[1];
	key.addr[2] = dst[2];
	key.addr[3] = dst[3];
	g = bpf_map_lookup_elem(&egress_grants, &key);
	if (!g || g->expiry <= now)
		return 0;
	n = g->nports;
	if (n == 0)
		return 1;
	return (n > 0 && port_allows(&g->ports[0], port, proto)) || (n > 1 && port_allows(&g->ports[1], port, proto)) ||
	       (n > 2 && port_allows(&g->ports[2], port, proto)) || (n > 3 && port_allows(&g->ports[3], port, proto)) ||
	       (n > 4 && port_allows(&g->ports[4], port, proto)) || (n > 5 && port_allows(&g->ports[5], port, proto)) ||
	       (n > 6 && port_allows(&g->ports[6], port, proto)) || (n > 7 && port_allows(&g->ports[7], port, proto));
}

/* Whether dst is in an internal prefix. */
static __always_inline int is_internal(const __u32 *dst)
{
	struct egress_lpm_key key = {};

	key.prefixlen = 128;
	key.addr[0] = dst[0];
	key.addr[1] = dst[1];
	key.addr[2] = dst[2];
	key.addr[3] = dst[3];
	return bpf_map_lookup_elem(&egress_internal, &key) != 0;
}

/*
 * What the capture path would find, without looking itself (no watch is
 * started or advanced): the resolver is stalled when a program's looks saw
 * its watch past stall_ns twice, stall_ns / 4 apart (see look).
 */
static __always_inline int resolver_seen_stalled(struct meshdns_config *cfg, __u64 now)
{
	__u32 zero = 0;
	struct meshdns_progress *p = bpf_map_lookup_elem(&progress, &zero);
	__u64 since, suspect;

	if (!p)
		return 0;
	since = *(volatile __u64 *)&p->watch_since;
	if (since == 0 || *(volatile __u64 *)&p->dequeued != *(volatile __u64 *)&p->watch_count)
		return 0;
	suspect = *(volatile __u64 *)&p->suspect_since;
	if (since > now || now - since <= cfg->stall_ns || suspect < since || suspect > now)
		return 0;
	return now - suspect > cfg->stall_ns / 4;
}

/*
 * Whether no agent serves: slot 0's UDP resolver socket of the first target
 * family is not registered (the agent died, or stopped and unregistered), or
 * the resolver stopped dequeuing (frozen, stuck): the DNS capture's fail-open
 * verdict.
 */
static __always_inline int agent_down(struct meshdns_config *cfg, __u64 now)
{
	enum resolver_sock_kind family = (cfg->flags & FLAG_TARGET4) ? RESOLVER_FAMILY_V4 : RESOLVER_FAMILY_V6;

	if (!resolver_listening(family, RESOLVER_PROTO_UDP, 0))
		return 1;
	return resolver_seen_stalled(cfg, now);
}

/*
 * The egress decision for a connect or send to dst (IPv4 as ::ffff:a.b.c.d;
 * v4 says so) port (host byte order), to a port other than 53. Returns the
 * program's verdict: 1 allow, 0 deny (the caller gets EPERM).
 */
static __always_inline int egress_check(struct bpf_sock_addr *ctx, const __u32 *dst, int v4, __u16 port)
{
	struct meshdns_config *cfg = get_config();
	struct egress_rule rule = {};
	struct egress_event ev = {};
	__u32 proto;
	__u64 now;

	if (!cfg || !(cfg->flags & FLAG_EGRESS))
		return 1;
	proto = ctx->protocol;
	if (proto == IPPROTO_MPTCP)
		proto = IPPROTO_TCP;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return 1;
	if (v4 ? is_v4_loopback(dst[3]) || ((cfg->flags & FLAG_TARGET4) && dst[3] == cfg->target4)
	       : is_v6_loopback(dst) || ((cfg->flags & FLAG_TARGET6) && v6_equal(dst, cfg->target6)))
		return 1;
	if (!find_workload(cfg, &rule))
		return 1;
	now = bpf_ktime_get_ns();
	if (grant_allows(rule.workload, dst, port, proto, now)) {
		count_egress(rule.workload, EGRESS_ALLOWED_GRANT);
		return 1;
	}
	if (!(rule.flags & EGRESS_INTERNAL_IN_SCOPE) && is_internal(dst)) {
		count_egress(rule.workload, EGRESS_ALLOWED_INTERNAL);
		return 1;
	}
	if (!(rule.flags & EGRESS_FAIL_CLOSED) && (agent_down(cfg, now) || failed_open_recently(rule.workload, now))) {
		count_egress(rule.workload, EGRESS_FAIL_OPEN);
		return 1;
	}
	ev.time = now;
	ev.cgroup_id = bpf_get_current_cgroup_id();
	ev.workload = rule.workload;
	ev.addr[0] = dst[0];
	ev.addr[1] = dst[1];
	ev.addr[2] = dst[2];
	ev.addr[3] = dst[3];
	ev.port = port;
	ev.proto = proto;
	ev.verdict = (rule.flags & EGRESS_ENFORCE) ? VERDICT_DENIED : VERDICT_AUDITED;
	if (bpf_ringbuf_output(&egress_events, &ev, sizeof(ev), 0) != 0)
		count_egress(rule.workload, EGRESS_EVENT_DROPPED);
	if (rule.flags & EGRESS_ENFORCE) {
		count_egress(rule.workload, EGRESS_DENIED);
		return 0;
	}
	count_egress(rule.workload, EGRESS_AUDITED);
	return 1;
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

	dst[0] = 0;
	dst[1] = 0;
	dst[2] = bpf_htonl(0x0000ffff);
	dst[3] = ctx->user_ip4;
	if (bpf_ntohs((__u16)port) != DNS_PORT)
		return egress_check(ctx, dst, 1, bpf_ntohs((__u16)port));
	cfg = get_config();
	if (!cfg)
		return 1;
	slot_port = decide(ctx, hook, cfg, dst, 1);
	if (!slot_port)
		return 1;
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

	dst[0] = ctx->user_ip6[0];
	dst[1] = ctx->user_ip6[1];
	dst[2] = ctx->user_ip6[2];
	dst[3] = ctx->user_ip6[3];
	v4 = is_v4_mapped(dst); /* a v4 query in disguise */
	if (bpf_ntohs((__u16)port) != DNS_PORT)
		return egress_check(ctx, dst, v4, bpf_ntohs((__u16)port));
	cfg = get_config();
	if (!cfg)
		return 1;
	slot_port = decide(ctx, hook, cfg, dst, v4);
	if (!slot_port)
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

/*
 * Copies into orig the original destination this socket recorded for the slot
 * of port (host byte order) and returns 1, or returns 0 (counted as map_miss
 * when port is one of our slot ports). Constant offsets only, as above.
 */
static __always_inline int lookup_orig(struct bpf_sock_addr *ctx, __u32 hook, struct meshdns_config *cfg,
				       __u16 port, __u32 *orig)
{
	struct sock_origs *st;
	struct bpf_sock *sk;
	__u32 slot1;

	if (port < cfg->base_port || port >= (__u32)cfg->base_port + cfg->num_slots)
		return 0;
	slot1 = port - cfg->base_port + 1;
	sk = ctx->sk;
	if (!sk) {
		count(hook, COUNTER_MAP_MISS);
		return 0;
	}
	st = bpf_sk_storage_get(&sock_state, sk, 0, 0);
	if (st && (copy_entry(&st->e[0], slot1, orig) || copy_entry(&st->e[1], slot1, orig) ||
		   copy_entry(&st->e[2], slot1, orig) || copy_entry(&st->e[3], slot1, orig)))
		return 1;
	count(hook, COUNTER_MAP_MISS);
	return 0;
}

static __always_inline int reverse4(struct bpf_sock_addr *ctx, __u32 hook)
{
	volatile __u32 port = ctx->user_port;
	struct meshdns_config *cfg = get_config();
	__u32 orig[4];

	if (!cfg || !(cfg->flags & FLAG_TARGET4) || ctx->user_ip4 != cfg->target4)
		return 1;
	if (!lookup_orig(ctx, hook, cfg, bpf_ntohs((__u16)port), orig))
		return 1;
	ctx->user_ip4 = orig[3];
	ctx->user_port = (__u32)bpf_htons(DNS_PORT);
	count(hook, COUNTER_REPLY_REWRITTEN);
	count_cgroup(CGROUP_REPLY_REWRITTEN);
	return 1;
}

static __always_inline int reverse6(struct bpf_sock_addr *ctx, __u32 hook)
{
	volatile __u32 port = ctx->user_port;
	struct meshdns_config *cfg = get_config();
	__u32 orig[4];
	__u32 src[4];

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
	if (!lookup_orig(ctx, hook, cfg, bpf_ntohs((__u16)port), orig))
		return 1;
	ctx->user_ip6[0] = orig[0];
	barrier();
	ctx->user_ip6[1] = orig[1];
	barrier();
	ctx->user_ip6[2] = orig[2];
	barrier();
	ctx->user_ip6[3] = orig[3];
	ctx->user_port = (__u32)bpf_htons(DNS_PORT);
	count(hook, COUNTER_REPLY_REWRITTEN);
	count_cgroup(CGROUP_REPLY_REWRITTEN);
	return 1;
}

#ifndef MESHDNS_WATCH_CLOCK

/* The flows bucket of a source port and protocol (the resolver computes the same). */
static __always_inline __u32 flow_bucket(__u32 port, __u32 proto)
{
	return ((port << 8 | proto) * 2654435761U) >> (32 - FLOW_BUCKET_BITS);
}

static __always_inline __u64 flow_mix(__u64 h, __u64 v)
{
	h ^= v;
	h *= 0xff51afd7ed558ccdULL;
	return h ^ (h >> 32);
}

/* The checksum of an entry's content; never 0 (0 marks a write in progress). */
static __always_inline __u64 flow_check(const struct flow_entry *e)
{
	__u64 h = 0x9e3779b97f4a7c15ULL;

	h = flow_mix(h, (__u64)e->addr[0] << 32 | e->addr[1]);
	h = flow_mix(h, (__u64)e->addr[2] << 32 | e->addr[3]);
	h = flow_mix(h, (__u64)e->port << 40 | (__u64)e->proto << 32 | e->tgid);
	h = flow_mix(h, e->cgroup_id);
	h = flow_mix(h, e->cookie);
	h = flow_mix(h, e->workload);
	return h | 1;
}

/*
 * Fills n's source address, port and protocol from a packet to a target on a
 * slot port; returns -1 for any other packet. The packet starts at its IP
 * header.
 */
static __always_inline int parse_query(struct __sk_buff *skb, struct meshdns_config *cfg, struct flow_entry *n)
{
	__u32 eth = skb->protocol, off;
	__be16 ports[2];
	__u16 dport;

	if (eth == bpf_htons(ETH_P_IP)) {
		struct ip4_hdr ip;

		if (!(cfg->flags & FLAG_TARGET4) || bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)))
			return -1;
		if (ip.daddr != cfg->target4 || (ip.frag_off & bpf_htons(0x1fff)))
			return -1;
		n->addr[0] = 0;
		n->addr[1] = 0;
		n->addr[2] = bpf_htonl(0x0000ffff);
		n->addr[3] = ip.saddr;
		n->proto = ip.protocol;
		off = (ip.ver_ihl & 0xf) * 4;
	} else if (eth == bpf_htons(ETH_P_IPV6)) {
		struct ip6_hdr ip6;

		if (!(cfg->flags & FLAG_TARGET6) || bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)))
			return -1;
		if (!v6_equal(ip6.daddr, cfg->target6))
			return -1;
		n->addr[0] = ip6.saddr[0];
		n->addr[1] = ip6.saddr[1];
		n->addr[2] = ip6.saddr[2];
		n->addr[3] = ip6.saddr[3];
		n->proto = ip6.nexthdr; /* extension headers: not a query of ours */
		off = sizeof(ip6);
	} else {
		return -1;
	}
	if (n->proto != IPPROTO_UDP && n->proto != IPPROTO_TCP)
		return -1;
	if (bpf_skb_load_bytes(skb, off, ports, sizeof(ports)))
		return -1;
	dport = bpf_ntohs(ports[1]);
	if (dport < cfg->base_port || dport >= (__u32)cfg->base_port + cfg->num_slots)
		return -1;
	n->port = bpf_ntohs(ports[0]);
	return 0;
}

/* Writes n into e: the checksum last, cleared first, so a reader never takes a half-written entry. */
static __always_inline void flow_write(struct flow_entry *e, const struct flow_entry *n)
{
	barrier_var(e);
	e->check = 0;
	barrier();
	e->addr[0] = n->addr[0];
	e->addr[1] = n->addr[1];
	e->addr[2] = n->addr[2];
	e->addr[3] = n->addr[3];
	e->port = n->port;
	e->proto = n->proto;
	e->tgid = n->tgid;
	e->cgroup_id = n->cgroup_id;
	e->cookie = n->cookie;
	e->stamp = n->stamp;
	e->workload = n->workload;
	barrier();
	e->check = n->check;
}

/* When e is n's flow, brings it up to date and returns 1. */
static __always_inline int flow_update(struct flow_entry *e, const struct flow_entry *n)
{
	barrier_var(e);
	if (e->port != n->port || e->proto != n->proto || e->addr[0] != n->addr[0] || e->addr[1] != n->addr[1] ||
	    e->addr[2] != n->addr[2] || e->addr[3] != n->addr[3])
		return 0;
	if (e->check != n->check || e->stamp == 0) {
		flow_write(e, n);
		count(HOOK_EGRESS, COUNTER_FLOW_RECORDED);
	}
	return 1;
}

static __always_inline __u64 flow_stamp(struct flow_entry *e)
{
	barrier_var(e);
	return e->stamp;
}

/* Records n in its bucket: in its own way, or a free one, or the one written longest ago. */
static __always_inline void record_flow(struct flow_entry *n)
{
	__u32 b = flow_bucket(n->port, n->proto), way = 0;
	struct flow_bucket *fb = bpf_map_lookup_elem(&flows, &b);
	__u64 s, oldest;

	if (!fb)
		return;
	n->check = flow_check(n);
	if (flow_update(&fb->e[0], n) || flow_update(&fb->e[1], n) || flow_update(&fb->e[2], n) ||
	    flow_update(&fb->e[3], n))
		return;
	oldest = flow_stamp(&fb->e[0]);
	s = flow_stamp(&fb->e[1]);
	if (s < oldest) {
		oldest = s;
		way = 1;
	}
	s = flow_stamp(&fb->e[2]);
	if (s < oldest) {
		oldest = s;
		way = 2;
	}
	s = flow_stamp(&fb->e[3]);
	if (s < oldest) {
		oldest = s;
		way = 3;
	}
	switch (way) {
	case 0:
		flow_write(&fb->e[0], n);
		break;
	case 1:
		flow_write(&fb->e[1], n);
		break;
	case 2:
		flow_write(&fb->e[2], n);
		break;
	default:
		flow_write(&fb->e[3], n);
	}
	count(HOOK_EGRESS, COUNTER_FLOW_RECORDED);
	if (oldest != 0)
		count(HOOK_EGRESS, COUNTER_FLOW_EVICTED);
}

/* Every packet a socket in the cgroup sends; see Attribution above. Never drops. */
SEC("cgroup_skb/egress")
int attribute(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	struct meshdns_config *cfg;
	struct sock_origs *st;
	struct flow_entry n = {};

	if (!sk)
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return 1;
	st = bpf_sk_storage_get(&sock_state, sk, 0, 0);
	if (!st || st->cgroup_id == 0)
		return 1; /* not a socket the forward programs redirected */
	cfg = get_config();
	if (!cfg || !(cfg->flags & FLAG_ATTRIBUTION) || parse_query(skb, cfg, &n) != 0)
		return 1;
	n.cgroup_id = st->cgroup_id;
	n.tgid = st->tgid;
	n.workload = st->workload;
	n.cookie = bpf_get_socket_cookie(skb);
	n.stamp = bpf_ktime_get_ns();
	record_flow(&n);
	if (st->flow_port != n.port || st->flow_proto != n.proto) {
		st->flow_port = n.port;
		st->flow_proto = n.proto;
	}
	return 1;
}

static __always_inline void flow_release(struct flow_entry *e, __u64 cookie)
{
	barrier_var(e);
	if (e->cookie == cookie && e->stamp != 0) {
		e->stamp = 0;
		count(HOOK_SOCK_RELEASE, COUNTER_FLOW_RELEASED);
	}
}

/* A socket closes: its flows entry becomes free (still readable until reused). */
SEC("cgroup/sock_release")
int sock_release(struct bpf_sock *ctx)
{
	struct sock_origs *st = bpf_sk_storage_get(&sock_state, ctx, 0, 0);
	struct flow_bucket *fb;
	__u64 cookie;
	__u32 b;

	if (!st || st->flow_port == 0)
		return 1;
	b = flow_bucket(st->flow_port, st->flow_proto);
	fb = bpf_map_lookup_elem(&flows, &b);
	if (!fb)
		return 1;
	cookie = bpf_get_socket_cookie(ctx);
	flow_release(&fb->e[0], cookie);
	flow_release(&fb->e[1], cookie);
	flow_release(&fb->e[2], cookie);
	flow_release(&fb->e[3], cookie);
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

#else /* MESHDNS_WATCH_CLOCK */

/*
 * The watch clock (a second object, built with -DMESHDNS_WATCH_CLOCK: BPF
 * timers need Linux 5.15, the programs above do not). A timer in the kernel
 * runs every CLOCK_TICK_NS, whether or not anything is being redirected: a
 * watch always runs from the resolver's last dequeue, and while clients are
 * sparse the clock looks for them, so a resolver frozen while its clients were
 * quiet is known to be stalled by the time the next one asks (the agent's watchdog sends an idle,
 * live resolver an empty datagram a quarter of stall_ns into a watch, so its
 * watches keep restarting). The timer belongs to the agent that started it:
 * the kernel cancels it when the last descriptor of watch_clock is closed.
 */
enum meshdns_clock {
	CLOCK_TICK_NS = 10000000,     /* a look every 10 ms */
	CLOCK_GAP_NS = 50000000,      /* a later tick: the machine did not run */
	CLOCK_SPARSE_NS = 20000000,   /* clients that look less often than this on average are sparse */
	CLOCK_SILENT_NS = 1000000000, /* clients that have not looked for this long are too */
};

struct watch_clock {
	struct bpf_timer timer;
	__u64 last_tick; /* bpf_ktime_get_ns of the previous tick */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct watch_clock);
	__uint(max_entries, 1);
} watch_clock SEC(".maps");

/*
 * One tick. It restarts the watch when something was dequeued, and takes a
 * look as a redirect would only while clients are sparse: on average more
 * than CLOCK_SPARSE_NS between the programs' looks, or none for
 * CLOCK_SILENT_NS. While clients ask every few ms, theirs are the looks that
 * count, as without a clock: clients that run when the resolver could have
 * run are what tells a resolver that does not read from one that was not
 * given a CPU (a machine whose user space is starved starves them both, and
 * the first client to run afterwards must not find the resolver declared
 * stalled). Sparse clients would give a frozen resolver one more query before
 * its next one is bypassed; for them the clock looks. A tick that comes
 * CLOCK_GAP_NS or more after the previous one found a machine that did not run
 * (a VM paused, every CPU taken by interrupts): the resolver could not have
 * dequeued either, so its watch starts afresh instead.
 */
static int clock_tick(void *map, __u32 *key, struct watch_clock *c)
{
	struct meshdns_config *cfg = get_config();
	__u32 zero = 0;
	struct meshdns_progress *p = bpf_map_lookup_elem(&progress, &zero);
	__u64 now = bpf_ktime_get_ns(), dequeued;

	if (cfg && p) {
		dequeued = *(volatile __u64 *)&p->dequeued;
		if (c->last_tick != 0 && now - c->last_tick >= CLOCK_GAP_NS)
			start_watch(p, dequeued, now);
		else if (*(volatile __u64 *)&p->client_gap > CLOCK_SPARSE_NS ||
			 now - *(volatile __u64 *)&p->client_look > CLOCK_SILENT_NS)
			look(cfg, p, now);
		else if (dequeued != *(volatile __u64 *)&p->watch_count)
			start_watch(p, dequeued, now);
	}
	if (p)
		p->clock_tick = now;
	c->last_tick = now;
	bpf_timer_start(&c->timer, CLOCK_TICK_NS, 0);
	return 0;
}

/* Run once by the agent (BPF_PROG_TEST_RUN): starts the clock. */
SEC("socket")
int watch_clock_start(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct watch_clock *c = bpf_map_lookup_elem(&watch_clock, &zero);
	long err;

	if (!c)
		return 1;
	err = bpf_timer_init(&c->timer, &watch_clock, CLOCK_MONOTONIC);
	if (err != 0)
		return 2; /* started already (-EBUSY), or no timers here */
	if (bpf_timer_set_callback(&c->timer, clock_tick) != 0)
		return 3;
	if (bpf_timer_start(&c->timer, CLOCK_TICK_NS, 0) != 0)
		return 4;
	return 0;
}

#endif /* MESHDNS_WATCH_CLOCK */

char LICENSE[] SEC("license") = "Dual BSD/GPL";
