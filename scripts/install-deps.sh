#!/usr/bin/env bash
# Installs what meshdns-ebpf needs to build, run and test on a Debian or Ubuntu
# machine, as root. Idempotent: a second run installs nothing new. The Vagrantfile
# provisions with this same script, and `make run` / `make test` call it.
#
#   scripts/install-deps.sh          # run + test dependencies
#   scripts/install-deps.sh --run    # only what the agent needs at run time
set -euo pipefail

want_test=1
[ "${1:-}" = "--run" ] && want_test=0

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps: must run as root (it installs packages)" >&2
  exit 1
fi

# Run time: iptables and conntrack for the fallback path and `status`, iproute2 for
# links and addresses, bpftool to inspect attachments by hand.
pkgs=(iptables conntrack nftables iproute2 bpftool ca-certificates)
if [ "$want_test" = 1 ]; then
  # Tests: real resolvers as clients (glibc getent from libc-bin, musl-gcc, dig),
  # setpriv to run clients as other UIDs, clang/llvm/libbpf-dev to check that the
  # committed BPF objects match the C source, gcc for the musl client; runc and the
  # CNI plugins (bridge, host-local, loopback) for the test node (test/node).
  pkgs+=(libc-bin musl-tools bind9-dnsutils util-linux gcc make clang llvm libbpf-dev git
    runc containernetworking-plugins)
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Go: the module needs Go >= 1.26. Use the one on PATH or in /usr/local/go.
export PATH="$PATH:/usr/local/go/bin"
if ! command -v go >/dev/null 2>&1; then
  echo "install-deps: Go >= 1.26 is required and none is installed." >&2
  echo "  Install it from the official Go download page into /usr/local/go, then rerun." >&2
  exit 1
fi
gover=$(go env GOVERSION | sed 's/^go//')
if [ "$(printf '%s\n1.26\n' "$gover" | sort -V | head -1)" != "1.26" ]; then
  echo "install-deps: Go $gover is too old; meshdns-ebpf needs Go >= 1.26" >&2
  exit 1
fi

# The kernel modules the datapath and the fallback use; absent modules are fine when
# built in, so only warn.
for m in nf_conntrack br_netfilter veth; do
  modprobe -q "$m" 2>/dev/null || true
done
echo "install-deps: ok (go $gover, kernel $(uname -r))"
