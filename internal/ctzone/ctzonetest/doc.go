// Package ctzonetest is the conntrack-collision workload of meshdns-ebpf's
// tests (Istio issue 33469): an application and a forwarding DNS proxy in one
// network namespace with a narrow ephemeral port range, so that the
// application's captured queries and the proxy's upstream queries keep reusing
// the same UDP 4-tuples, and a fake upstream in a peer namespace that answers
// NXDOMAIN for mesh names. A capture installer (Istio's pre-1.11 rules,
// meshdns-ebpf's iptables mode, or its eBPF mode) is plugged in, and the
// workload counts mesh queries that were misrouted to the upstream.
//
// Test binaries using it must call MaybeRunHelper first in TestMain: the proxy
// and the application are that binary re-executed as other users.
//
// It is Linux-only (network namespaces, iptables, conntrack).
package ctzonetest
