// Package deploy tests what an operator installs: the OCI image `make image`
// builds (reproducible from a clean checkout, its binary and its iptables run
// from the unpacked root filesystem, the agent's fallback works with them) and
// the manifests in deploy/kubernetes (rendered with kustomize as `kubectl apply
// -k` does, decoded strictly into the Kubernetes API types, and held to the
// least-privilege rules of docs/kubernetes.md).
package deploy
