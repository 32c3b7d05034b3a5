/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Minimal, self-contained definitions for meshdns-ebpf's cgroup programs:
 * the few UAPI constants and context structs they use (layouts as in the
 * kernel's include/uapi/linux/bpf.h) and the helper declarations (helper ids as
 * in the same file). Kept in-tree and free of system includes so the generated
 * object is byte-for-byte reproducible whatever kernel or libbpf headers the
 * build machine has.
 */
#ifndef MESHDNS_BPF_H
#define MESHDNS_BPF_H

typedef unsigned char __u8;
typedef unsigned short __u16;
typedef unsigned int __u32;
typedef unsigned long long __u64;
typedef signed int __s32;
typedef signed long long __s64;
typedef __u16 __be16;
typedef __u32 __be32;

#define __bpf_md_ptr(type, name) \
	union {                      \
		type name;               \
		__u64 : 64;              \
	} __attribute__((aligned(8)))

/* enum bpf_map_type */
#define BPF_MAP_TYPE_HASH 1
#define BPF_MAP_TYPE_ARRAY 2
#define BPF_MAP_TYPE_PERCPU_ARRAY 6
#define BPF_MAP_TYPE_LRU_HASH 9
#define BPF_MAP_TYPE_LRU_PERCPU_HASH 10
#define BPF_MAP_TYPE_SOCKMAP 15
#define BPF_MAP_TYPE_SK_STORAGE 24
#define BPF_MAP_TYPE_RINGBUF 27
#define BPF_MAP_TYPE_PERCPU_HASH 5
#define BPF_MAP_TYPE_LPM_TRIE 11

/* map update flags */
#define BPF_ANY 0
#define BPF_NOEXIST 1
#define BPF_EXIST 2

/* map creation flags */
#define BPF_F_NO_PREALLOC (1U << 0)
#define BPF_F_MMAPABLE (1U << 10)

/* bpf_sk_storage_get flags */
#define BPF_SK_STORAGE_GET_F_CREATE (1ULL << 0)

#define AF_INET 2
#define AF_INET6 10
#define SOCK_STREAM 1
#define SOCK_DGRAM 2
#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define IPPROTO_MPTCP 262
#define SOL_SOCKET 1
#define SO_MARK 36
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD


struct bpf_sock {
	__u32 bound_dev_if;
	__u32 family;
	__u32 type;
	__u32 protocol;
	__u32 mark;
	__u32 priority;
	__u32 src_ip4;
	__u32 src_ip6[4];
	__u32 src_port;
	__be16 dst_port;
	__u16 : 16;
	__u32 dst_ip4;
	__u32 dst_ip6[4];
	__u32 state;
	__s32 rx_queue_mapping;
};

struct bpf_sock_addr {
	__u32 user_family;
	__u32 user_ip4;    /* network byte order */
	__u32 user_ip6[4]; /* network byte order */
	__u32 user_port;   /* network byte order, in the low 16 bits */
	__u32 family;
	__u32 type;
	__u32 protocol;
	__u32 msg_src_ip4;
	__u32 msg_src_ip6[4];
	__bpf_md_ptr(struct bpf_sock *, sk);
};

/* The lookup key of bpf_sk_lookup_tcp/udp. */
struct bpf_sock_tuple {
	union {
		struct {
			__be32 saddr;
			__be32 daddr;
			__be16 sport;
			__be16 dport;
		} ipv4;
		struct {
			__be32 saddr[4];
			__be32 daddr[4];
			__be16 sport;
			__be16 dport;
		} ipv6;
	};
};

/* bpf_sk_lookup_*: in the network namespace of the program's context. */
#define BPF_F_CURRENT_NETNS (-1L)

/* struct __sk_buff up to its sk pointer (cgroup_skb programs). */
struct __sk_buff {
	__u32 len;
	__u32 pkt_type;
	__u32 mark;
	__u32 queue_mapping;
	__u32 protocol; /* ethertype, network byte order */
	__u32 vlan_present;
	__u32 vlan_tci;
	__u32 vlan_proto;
	__u32 priority;
	__u32 ingress_ifindex;
	__u32 ifindex;
	__u32 tc_index;
	__u32 cb[5];
	__u32 hash;
	__u32 tc_classid;
	__u32 data;
	__u32 data_end;
	__u32 napi_id;
	__u32 family;
	__u32 remote_ip4;
	__u32 local_ip4;
	__u32 remote_ip6[4];
	__u32 local_ip6[4];
	__u32 remote_port;
	__u32 local_port;
	__u32 data_meta;
	__bpf_md_ptr(void *, flow_keys);
	__u64 tstamp;
	__u32 wire_len;
	__u32 gso_segs;
	__bpf_md_ptr(struct bpf_sock *, sk);
};

/* The start of an IPv4 header (no options) and of an IPv6 header. */
struct ip4_hdr {
	__u8 ver_ihl; /* version << 4 | header length in words */
	__u8 tos;
	__be16 tot_len;
	__be16 id;
	__be16 frag_off;
	__u8 ttl;
	__u8 protocol;
	__u16 check;
	__be32 saddr;
	__be32 daddr;
};

struct ip6_hdr {
	__be32 ver_tc_flow;
	__be16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	__u32 saddr[4];
	__u32 daddr[4];
};

/* A BPF timer in a map value (opaque to programs). */
struct bpf_timer {
	__u64 : 64;
	__u64 : 64;
} __attribute__((aligned(8)));

#define CLOCK_MONOTONIC 1

#define SEC(name) __attribute__((section(name), used))
#define __always_inline inline __attribute__((always_inline))
#define __uint(name, val) int(*name)[val]
#define __type(name, val) typeof(val) *name
#define barrier() asm volatile("" ::: "memory")

/* Helpers (ids from enum bpf_func_id). */
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value, __u64 flags) = (void *)2;
static long (*bpf_map_delete_elem)(void *map, const void *key) = (void *)3;
static __u64 (*bpf_ktime_get_ns)(void) = (void *)5;
static __u64 (*bpf_get_current_pid_tgid)(void) = (void *)14;
static __u64 (*bpf_get_current_uid_gid)(void) = (void *)15;
static long (*bpf_skb_load_bytes)(const void *skb, __u32 offset, void *to, __u32 len) = (void *)26;
static __u64 (*bpf_get_socket_cookie)(void *ctx) = (void *)46;
static long (*bpf_getsockopt)(void *bpf_socket, int level, int optname, void *optval, int optlen) = (void *)57;
static __u64 (*bpf_get_current_cgroup_id)(void) = (void *)80;
static struct bpf_sock *(*bpf_sk_lookup_tcp)(void *ctx, struct bpf_sock_tuple *tuple, __u32 tuple_size, __u64 netns, __u64 flags) = (void *)84;
static struct bpf_sock *(*bpf_sk_lookup_udp)(void *ctx, struct bpf_sock_tuple *tuple, __u32 tuple_size, __u64 netns, __u64 flags) = (void *)85;
static long (*bpf_sk_release)(void *sock) = (void *)86;
static struct bpf_sock *(*bpf_sk_fullsock)(struct bpf_sock *sk) = (void *)95;
static void *(*bpf_sk_storage_get)(void *map, void *sk, void *value, __u64 flags) = (void *)107;
static __u64 (*bpf_get_netns_cookie)(void *ctx) = (void *)122;
static __u64 (*bpf_get_current_ancestor_cgroup_id)(int ancestor_level) = (void *)123;
static long (*bpf_ringbuf_output)(void *ringbuf, void *data, __u64 size, __u64 flags) = (void *)130;
static long (*bpf_timer_init)(struct bpf_timer *timer, void *map, __u64 flags) = (void *)169;
static long (*bpf_timer_set_callback)(struct bpf_timer *timer, void *callback_fn) = (void *)170;
static long (*bpf_timer_start)(struct bpf_timer *timer, __u64 nsecs, __u64 flags) = (void *)171;

/* The BPF targets we build for (bpfel) are little-endian. */
#define bpf_htons(x) ((__u16)__builtin_bswap16((__u16)(x)))
#define bpf_ntohs(x) ((__u16)__builtin_bswap16((__u16)(x)))
#define bpf_htonl(x) ((__u32)__builtin_bswap32((__u32)(x)))
#define bpf_ntohl(x) ((__u32)__builtin_bswap32((__u32)(x)))

#endif /* MESHDNS_BPF_H */
