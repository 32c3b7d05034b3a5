// Package nodetest runs a whole single-node Kubernetes cluster on this machine for
// a test: etcd, kube-apiserver, kube-controller-manager (internal/kubetest),
// kube-scheduler, containerd 2 with runc, kubelet and kube-proxy, with a CNI
// bridge for the pods. Everything runs inside one network namespace and one
// persistent private mount namespace the test creates, and the pods live under a
// cgroup root of the test's own, so nothing of the machine changes:
//
//   - the node's network namespace is joined by a veth pair to a second namespace
//     (its "gateway"), never to the machine's;
//   - the mount namespace has an overlay over /var/lib, its own /var/log and /run,
//     a bpffs of its own at /sys/fs/bpf, and files bind-mounted over the six
//     sysctls kubelet rewrites (kubelet would otherwise change the machine's);
//   - the cgroup root is made in every v1 hierarchy and in the unified one, and
//     removed, depth first, at the end.
//
// Start records the machine's sysctls, network namespaces, mounts and top-level
// cgroups before it builds anything and fails the test if any of them differ
// after the teardown, which also runs when the test fails. The binaries come from
// `scripts/build-kube.sh node` (.cache/node-bin or $MESHDNS_NODE_BIN) and the
// control plane's (kubetest); runc and the CNI plugins are Debian's.
package nodetest
